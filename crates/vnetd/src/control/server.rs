//! Control sessions over TCP and Unix sockets.
//!
//! Protocol: the client sends lines. A line on its own is a request. Lines
//! between `BEGIN` and `COMMIT` are one request, applied all or nothing
//! (`ABORT` discards them). Every request gets one reply:
//!
//! ```text
//! OK <n>            followed by n lines of output
//! ERR <message>     one line; nothing was changed
//! ```
//!
//! When vnetd has a control token, a TCP session's first line must be
//! `AUTH <token>`; anything else, or a wrong token, ends the session. The
//! Unix socket is guarded by its file permissions (owner only) instead.

use super::Control;
use anyhow::{Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Longest control line accepted; longer ones end the session.
pub const MAX_LINE: usize = 4096;
/// Most lines in one BEGIN..COMMIT request.
pub const MAX_REQUEST_LINES: usize = 100_000;
/// Most control sessions at once; further connections are refused.
pub const MAX_SESSIONS: usize = 64;
/// Most requests one session may make per second; beyond, it is slowed down.
pub const MAX_REQUESTS_PER_SEC: u32 = 1000;

static SESSIONS: AtomicUsize = AtomicUsize::new(0);

pub fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("cannot bind control TCP {addr}: {e}"))
}

/// Binds the Unix control socket, owner-only. A stale socket file (no daemon
/// answers on it) is replaced; a live one is an error.
pub fn bind_unix(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            anyhow::bail!("control socket {} is in use by a running vnetd", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("cannot remove stale {}", path.display()))?;
    }
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot bind control socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Reads a control token from a file only its owner can read.
pub fn read_token(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read control token {}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        anyhow::bail!("control token {} is readable by others (chmod 600 it)", path.display());
    }
    let token = std::fs::read_to_string(path).with_context(|| format!("cannot read control token {}", path.display()))?;
    let token = token.trim().to_string();
    if token.len() < 16 || token.contains(char::is_whitespace) {
        anyhow::bail!("control token {} must be at least 16 characters, without spaces", path.display());
    }
    Ok(token)
}

pub fn spawn_tcp(ctl: Arc<Control>, l: TcpListener, token: Option<String>) {
    let token: Option<Arc<str>> = token.map(Into::into);
    std::thread::Builder::new()
        .name("control-tcp".into())
        .spawn(move || {
            for conn in l.incoming().flatten() {
                let _ = conn.set_nodelay(true);
                let Ok(w) = conn.try_clone() else { continue };
                spawn_session(ctl.clone(), conn, w, token.clone());
            }
        })
        .expect("spawn control thread");
}

pub fn spawn_unix(ctl: Arc<Control>, l: UnixListener, path: PathBuf) {
    std::thread::Builder::new()
        .name("control-unix".into())
        .spawn(move || {
            for conn in l.incoming().flatten() {
                let Ok(w) = conn.try_clone() else { continue };
                spawn_session(ctl.clone(), conn, w, None);
            }
            let _ = std::fs::remove_file(path);
        })
        .expect("spawn control thread");
}

fn spawn_session<R: Read + Send + 'static, W: Write + Send + 'static>(
    ctl: Arc<Control>,
    r: R,
    mut w: W,
    token: Option<Arc<str>>,
) {
    if SESSIONS.fetch_add(1, Ordering::AcqRel) >= MAX_SESSIONS {
        SESSIONS.fetch_sub(1, Ordering::AcqRel);
        let _ = writeln!(w, "ERR too many control sessions (at most {MAX_SESSIONS})");
        return;
    }
    let spawned = std::thread::Builder::new().name("control-session".into()).spawn(move || {
        serve(&ctl, BufReader::new(r), w, token.as_deref());
        SESSIONS.fetch_sub(1, Ordering::AcqRel);
    });
    if spawned.is_err() {
        SESSIONS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Compares two strings in time that depends only on their lengths.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves one session until the peer closes it. With a `token`, the first
/// line must be `AUTH <token>`.
pub fn serve<R: BufRead, W: Write>(ctl: &Control, mut r: R, mut w: W, token: Option<&str>) {
    let mut pending: Option<Vec<String>> = None;
    let mut line = Vec::new();
    if let Some(token) = token {
        let ok = (&mut r).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line).is_ok()
            && std::str::from_utf8(&line)
                .ok()
                .and_then(|l| l.trim_end().strip_prefix("AUTH "))
                .is_some_and(|t| same_secret(t, token));
        if !ok {
            tracing::warn!("control session refused: bad or missing AUTH");
            // Slow down guessing.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let _ = writeln!(w, "ERR authentication required (first line: AUTH <token>)");
            return;
        }
        let _ = writeln!(w, "OK 0");
    }
    let mut window = std::time::Instant::now();
    let mut in_window = 0u32;
    loop {
        line.clear();
        match (&mut r).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.len() > MAX_LINE {
            let _ = writeln!(w, "ERR line longer than {MAX_LINE} bytes; closing the session");
            return;
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            let _ = writeln!(w, "ERR line is not UTF-8 text");
            pending = None;
            continue;
        };
        let text = text.trim_end_matches(['\n', '\r']);
        let word = text.trim().to_ascii_lowercase();
        let reply = match (word.as_str(), pending.as_mut()) {
            ("begin", None) => {
                pending = Some(Vec::new());
                continue;
            }
            ("begin", Some(_)) => Err("BEGIN inside a request (send COMMIT or ABORT first)".to_string()),
            ("commit", Some(_)) => {
                let req = pending.take().unwrap().join("\n");
                ctl.execute(&req)
            }
            ("abort", Some(_)) => {
                pending = None;
                Ok(vec![])
            }
            ("commit" | "abort", None) => Err(format!("{} without BEGIN", word.to_uppercase())),
            (_, Some(lines)) => {
                if lines.len() >= MAX_REQUEST_LINES {
                    pending = None;
                    Err(format!("request longer than {MAX_REQUEST_LINES} lines; discarded"))
                } else {
                    lines.push(text.to_string());
                    continue;
                }
            }
            ("", None) => continue,
            (_, None) => ctl.execute(text),
        };
        // Requests are rate-bounded: past the limit, a session waits.
        in_window += 1;
        if in_window > MAX_REQUESTS_PER_SEC {
            let left = std::time::Duration::from_secs(1).saturating_sub(window.elapsed());
            std::thread::sleep(left);
        }
        if window.elapsed() >= std::time::Duration::from_secs(1) {
            window = std::time::Instant::now();
            in_window = 0;
        }
        let mut msg = String::new();
        match reply {
            Ok(lines) => {
                msg.push_str(&format!("OK {}\n", lines.len()));
                for l in lines {
                    msg.push_str(&l);
                    msg.push('\n');
                }
            }
            Err(e) => msg.push_str(&format!("ERR {}\n", e.replace('\n', " "))),
        }
        if w.write_all(msg.as_bytes()).and_then(|_| w.flush()).is_err() {
            return;
        }
    }
}
