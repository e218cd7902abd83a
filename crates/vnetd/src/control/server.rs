//! Control sessions over the Unix socket and (when asked for) TCP.
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
//! `FORMAT json` (outside BEGIN..COMMIT) asks for every later reply of the
//! session, that one's included, as one line of JSON (`json`'s); `FORMAT
//! text` asks for the lines above again. A vnetd that predates FORMAT
//! answers it `ERR ... unknown command`, so a client knows to fall back.
//!
//! `WAIT [<count> [<ms>]]` (outside BEGIN..COMMIT) waits until what the
//! listings show changed: `changes <n>`, how many times it has (a request
//! that changed something committed, or a VM's rings started or stopped,
//! `stats::Changes`), once the count is no longer `<count>` or after `<ms>`
//! (default and most: `WAIT_MOST`); without a count it answers at once. A
//! client that lists after each answer sees every change, and waits for none.
//!
//! Who may connect, and as what, is `access`'s business: on the Unix socket
//! the kernel's peer credentials decide; a TCP session's first line must be
//! `AUTH <token>`, and anything else ends it. Every session has deadlines
//! (to authenticate, between requests, to finish a request it started), and
//! each listener caps its sessions, in all and per client, so no client can
//! shut the others out; root's Unix sessions have slots of their own.

use super::access::{self, Caller, Client, Gate, Lockout, RateLimit, Tokens, UnixPolicy};
use super::json;
use super::Control;
use anyhow::{Context, Result};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest control line accepted; longer ones end the session.
pub const MAX_LINE: usize = 4096;
/// Most lines in one BEGIN..COMMIT request.
pub const MAX_REQUEST_LINES: usize = 100_000;
/// Most bytes in one BEGIN..COMMIT request.
pub const MAX_REQUEST_BYTES: usize = 16 << 20;
/// A TCP session must authenticate within this.
pub const AUTH_TIME: Duration = Duration::from_secs(10);
/// A session idle this long between requests is closed.
pub const IDLE_TIME: Duration = Duration::from_secs(300);
/// A request (a line, or BEGIN..COMMIT) must arrive whole within this of its
/// first byte.
pub const REQUEST_TIME: Duration = Duration::from_secs(30);
/// A reply the client does not read within this ends the session.
pub const WRITE_TIME: Duration = Duration::from_secs(10);
/// The longest `WAIT` (well inside the idle bound).
pub const WAIT_MOST: Duration = Duration::from_secs(60);
/// A bad token is answered only after this, to slow guessing.
pub const AUTH_DELAY: Duration = Duration::from_millis(200);
/// Unix sessions of root and of vnetd's own user, who never compete with
/// anyone else for a slot.
pub const SUPERUSER_SESSIONS: usize = 32;
/// Unix sessions of everyone else (the control group), and TCP sessions.
pub const SESSIONS: usize = 32;
/// Sessions one client (a uid, or an address) may hold on one listener.
pub const SESSIONS_PER_CLIENT: usize = 8;

pub fn bind_tcp(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| anyhow::anyhow!("cannot bind control TCP {addr}: {e}"))
}

/// Binds the Unix control socket: mode 0600 from the moment it exists, or
/// 0660 with group `group`. A stale socket file (no daemon answers on it) is
/// replaced; a live one, or anything that is not a socket, is an error.
pub fn bind_unix(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket: not replacing it", path.display());
        }
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
    // The socket is born owner-only: no moment in which others may connect.
    // (umask is process-wide; vnetd binds before it starts any thread.)
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let l = bound.map_err(|e| anyhow::anyhow!("cannot bind control socket {}: {e}", path.display()))?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    }
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

/// Accepts until the listener fails for good; a transient error (no file
/// descriptors left) is waited out instead of spun on.
fn accept_loop<T>(name: &str, mut accept: impl FnMut() -> io::Result<T>, mut admit: impl FnMut(T)) {
    let mut last_warned: Option<Instant> = None;
    loop {
        match accept() {
            Ok(c) => admit(c),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                if last_warned.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!("control {name}: accept failed: {e}");
                    last_warned = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

pub fn spawn_tcp(ctl: Arc<Control>, l: TcpListener, tokens: Tokens) {
    let tokens = Arc::new(tokens);
    let lockout = Arc::new(Lockout::default());
    let gate = Gate::new("tcp", SESSIONS, SESSIONS_PER_CLIENT);
    std::thread::Builder::new()
        .name("control-tcp".into())
        .spawn(move || {
            accept_loop("tcp", || l.accept(), |(conn, peer)| admit_tcp(&ctl, conn, peer, &tokens, &lockout, &gate));
        })
        .expect("spawn control thread");
}

fn admit_tcp(ctl: &Arc<Control>, mut conn: TcpStream, peer: SocketAddr, tokens: &Arc<Tokens>, lockout: &Arc<Lockout>, gate: &Arc<Gate>) {
    let _ = conn.set_nodelay(true);
    let _ = conn.set_write_timeout(Some(WRITE_TIME));
    if let Some(left) = lockout.locked(peer.ip(), Instant::now()) {
        tracing::warn!("control: refused {peer}: locked out after bad tokens ({}s left)", left.as_secs() + 1);
        let _ = writeln!(conn, "ERR locked out after too many bad tokens; try again in {} s", left.as_secs() + 1);
        return;
    }
    let ticket = match gate.enter(Client::addr(peer.ip())) {
        Ok(t) => t,
        Err(why) => {
            tracing::warn!("control: refused {peer}: {why}");
            let _ = writeln!(conn, "ERR {why}");
            return;
        }
    };
    let (ctl, tokens, lockout) = (ctl.clone(), tokens.clone(), lockout.clone());
    let _ = std::thread::Builder::new().name("control-session".into()).spawn(move || {
        let _ticket = ticket;
        let mut s = Session::new(conn);
        if let Some(caller) = authenticate(&mut s, peer, &tokens, &lockout) {
            serve(&ctl, &mut s, &caller);
        }
    });
}

/// A TCP session's first line must be `AUTH <token>`: returns who it is, or
/// None (the session ends) for anything else.
fn authenticate<C: Conn>(s: &mut Session<C>, peer: SocketAddr, tokens: &Tokens, lockout: &Lockout) -> Option<Caller> {
    let deadline = Instant::now() + AUTH_TIME;
    let mut line = Vec::new();
    match s.read_line(&mut line, |_| deadline) {
        Ok(()) => {}
        Err(End::TimedOut) => {
            tracing::debug!("control: {peer} sent no AUTH within {}s", AUTH_TIME.as_secs());
            s.reply(&format!("ERR no AUTH within {} s; closing", AUTH_TIME.as_secs()));
            return None;
        }
        Err(End::TooLong) | Err(End::Closed) => return None,
    }
    let text = std::str::from_utf8(&line).unwrap_or("").trim_end_matches('\r');
    let Some(given) = text.strip_prefix("AUTH ") else {
        tracing::warn!("control: {peer} did not authenticate (first line is not AUTH); closing");
        s.reply("ERR authentication required (first line: AUTH <token>)");
        return None;
    };
    match tokens.check(given) {
        Some(role) => {
            lockout.succeeded(peer.ip());
            let caller = Caller { role, who: format!("{peer} (tcp)") };
            tracing::info!("control: {caller} authenticated");
            s.reply("OK 0").then_some(caller)
        }
        None => {
            let locked = lockout.failed(peer.ip(), Instant::now());
            if locked {
                tracing::warn!(
                    "control: bad token from {peer}; {} in a row: locked out for {}s",
                    access::MAX_AUTH_FAILURES,
                    access::LOCKOUT.as_secs()
                );
            } else {
                tracing::warn!("control: bad token from {peer}");
            }
            std::thread::sleep(AUTH_DELAY);
            s.reply("ERR authentication required (first line: AUTH <token>): bad token");
            None
        }
    }
}

pub fn spawn_unix(ctl: Arc<Control>, l: UnixListener, path: PathBuf, policy: UnixPolicy) {
    let supers = Gate::new("superuser", SUPERUSER_SESSIONS, SUPERUSER_SESSIONS);
    let others = Gate::new("unix", SESSIONS, SESSIONS_PER_CLIENT);
    std::thread::Builder::new()
        .name("control-unix".into())
        .spawn(move || {
            accept_loop("unix", || l.accept(), |(conn, _)| admit_unix(&ctl, conn, &policy, &supers, &others));
            let _ = std::fs::remove_file(path);
        })
        .expect("spawn control thread");
}

fn admit_unix(ctl: &Arc<Control>, mut conn: UnixStream, policy: &UnixPolicy, supers: &Arc<Gate>, others: &Arc<Gate>) {
    let _ = conn.set_write_timeout(Some(WRITE_TIME));
    let creds = match access::peer_creds(conn.as_fd()) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("control: refused a unix peer: cannot read its credentials: {e}");
            return;
        }
    };
    let role = match policy.admit(&creds) {
        Ok(r) => r,
        Err(why) => {
            tracing::warn!("control: refused pid {}: {why}", creds.pid);
            let _ = writeln!(conn, "ERR permission denied: {why}");
            return;
        }
    };
    let gate = if policy.is_superuser(creds.uid) { supers } else { others };
    let ticket = match gate.enter(Client::Uid(creds.uid)) {
        Ok(t) => t,
        Err(why) => {
            tracing::warn!("control: refused uid {} pid {}: {why}", creds.uid, creds.pid);
            let _ = writeln!(conn, "ERR {why}");
            return;
        }
    };
    let caller = Caller { role, who: format!("uid {} pid {} (unix)", creds.uid, creds.pid) };
    let ctl = ctl.clone();
    let _ = std::thread::Builder::new().name("control-session".into()).spawn(move || {
        let _ticket = ticket;
        serve(&ctl, &mut Session::new(conn), &caller);
    });
}

/// A control connection: a byte stream whose reads can time out.
pub trait Conn: Read + Write {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Conn for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

impl Conn for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
}

/// Why a session stops reading.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Closed,
    TimedOut,
    TooLong,
}

/// How a session's replies are written (`FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Text,
    Json,
}

/// One connection, read a line at a time against deadlines.
struct Session<C> {
    conn: C,
    format: Format,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// When the first byte of the line being read arrived.
    partial_since: Option<Instant>,
}

impl<C: Conn> Session<C> {
    fn new(conn: C) -> Session<C> {
        Session { conn, format: Format::Text, buf: vec![0; 64 * 1024].into_boxed_slice(), start: 0, end: 0, partial_since: None }
    }

    /// Reads the next line (without its newline) into `line`. `deadline`
    /// gets when the line began (None: nothing of it yet) and says when to
    /// give up.
    fn read_line(&mut self, line: &mut Vec<u8>, deadline: impl Fn(Option<Instant>) -> Instant) -> Result<(), End> {
        loop {
            if let Some(i) = self.buf[self.start..self.end].iter().position(|&b| b == b'\n') {
                line.clear();
                line.extend_from_slice(&self.buf[self.start..self.start + i]);
                self.start += i + 1;
                self.partial_since = (self.start < self.end).then(Instant::now);
                return if line.len() > MAX_LINE { Err(End::TooLong) } else { Ok(()) };
            }
            if self.end - self.start > MAX_LINE {
                return Err(End::TooLong);
            }
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let now = Instant::now();
            let Some(left) = deadline(self.partial_since).checked_duration_since(now).filter(|d| !d.is_zero()) else {
                return Err(End::TimedOut);
            };
            if self.conn.set_read_timeout(Some(left)).is_err() {
                return Err(End::Closed);
            }
            match self.conn.read(&mut self.buf[self.end..]) {
                Ok(0) => return Err(End::Closed),
                Ok(n) => {
                    self.partial_since.get_or_insert(now);
                    self.end += n;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(_) => return Err(End::Closed),
            }
        }
    }

    /// Sends a one-line reply (`OK 0` or `ERR ...`) in the session's
    /// format; false when the client is gone or does not read.
    fn reply(&mut self, msg: &str) -> bool {
        match (self.format, msg.strip_prefix("ERR ")) {
            (Format::Json, Some(e)) => self.send(&json::error(e)),
            (Format::Json, None) => self.send(&json::reply(&Ok(vec![]), false)),
            (Format::Text, _) => self.send(msg),
        }
    }

    /// Sends a request's reply in the session's format.
    fn answer(&mut self, reply: &Result<Vec<String>, String>, help: bool) -> bool {
        if self.format == Format::Json {
            return self.send(&json::reply(reply, help));
        }
        let mut msg = String::new();
        match reply {
            Ok(lines) => {
                msg.push_str(&format!("OK {}\n", lines.len()));
                for l in lines {
                    msg.push_str(l);
                    msg.push('\n');
                }
            }
            Err(e) => msg.push_str(&format!("ERR {}\n", e.replace('\n', " "))),
        }
        self.send(&msg)
    }

    fn send(&mut self, msg: &str) -> bool {
        let mut text = String::with_capacity(msg.len() + 1);
        text.push_str(msg);
        if !msg.ends_with('\n') {
            text.push('\n');
        }
        self.conn.write_all(text.as_bytes()).and_then(|_| self.conn.flush()).is_ok()
    }
}

/// A BEGIN..COMMIT request being collected.
struct Pending {
    lines: Vec<String>,
    bytes: usize,
    since: Instant,
}

/// Serves an admitted session until the peer closes it or breaks a bound.
fn serve<C: Conn>(ctl: &Control, s: &mut Session<C>, caller: &Caller) {
    tracing::debug!("control: {caller}: session opened");
    let mut pending: Option<Pending> = None;
    let mut line = Vec::new();
    let mut idle_since = Instant::now();
    let mut limit = RateLimit::new(Instant::now());
    loop {
        let began = pending.as_ref().map(|p| p.since);
        let read = s.read_line(&mut line, |partial| match began.or(partial) {
            Some(t) => t + REQUEST_TIME,
            None => idle_since + IDLE_TIME,
        });
        match read {
            Ok(()) => {}
            Err(End::Closed) => break,
            Err(End::TooLong) => {
                s.reply(&format!("ERR line longer than {MAX_LINE} bytes; closing the session"));
                break;
            }
            Err(End::TimedOut) => {
                let why = if began.is_some() || s.partial_since.is_some() {
                    format!("request not finished within {} s", REQUEST_TIME.as_secs())
                } else {
                    format!("idle for {} s", IDLE_TIME.as_secs())
                };
                tracing::debug!("control: {caller}: {why}; closing");
                s.reply(&format!("ERR {why}; closing the session"));
                break;
            }
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            pending = None;
            if !s.reply("ERR line is not UTF-8 text") {
                break;
            }
            continue;
        };
        let text = text.trim_end_matches('\r');
        let word = text.trim().to_ascii_lowercase();
        let mut help = false;
        let reply = match (word.as_str(), pending.as_mut()) {
            ("begin", None) => {
                pending = Some(Pending { lines: Vec::new(), bytes: 0, since: Instant::now() });
                continue;
            }
            ("begin", Some(_)) => Err("BEGIN inside a request (send COMMIT or ABORT first)".to_string()),
            ("commit", Some(_)) => {
                let req = pending.take().expect("matched Some").lines.join("\n");
                ctl.execute(&req, caller)
            }
            ("abort", Some(_)) => {
                pending = None;
                Ok(vec![])
            }
            ("commit" | "abort", None) => Err(format!("{} without BEGIN", word.to_uppercase())),
            (_, Some(p)) => {
                if p.lines.len() >= MAX_REQUEST_LINES || p.bytes + text.len() + 1 > MAX_REQUEST_BYTES {
                    pending = None;
                    Err(format!("request longer than {MAX_REQUEST_LINES} lines or {MAX_REQUEST_BYTES} bytes; discarded"))
                } else {
                    p.bytes += text.len() + 1;
                    p.lines.push(text.to_string());
                    continue;
                }
            }
            ("", None) => continue,
            (w, None) if w.starts_with("auth ") || w == "auth" => {
                Err(format!("already authenticated as {caller}"))
            }
            (w, None) if w.split_whitespace().next() == Some("format") => {
                match w.split_whitespace().collect::<Vec<_>>()[..] {
                    [_, "json"] => {
                        s.format = Format::Json;
                        Ok(vec![])
                    }
                    [_, "text"] => {
                        s.format = Format::Text;
                        Ok(vec![])
                    }
                    _ => Err(format!("FORMAT needs json or text: {text}")),
                }
            }
            (w, None) if w.split_whitespace().next() == Some("wait") => wait(ctl, w),
            (w, None) => {
                help = w == "help";
                ctl.execute(text, caller)
            }
        };
        // Requests are rate-bounded: past the limit, a session waits.
        let wait = limit.take(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        if !s.answer(&reply, help) {
            break;
        }
        idle_since = Instant::now();
    }
    tracing::debug!("control: {caller}: session closed");
}

/// `WAIT [<count> [<ms>]]`: `changes <n>` once the count of changes is no
/// longer `<count>` (at once without one), or after `<ms>`.
fn wait(ctl: &Control, line: &str) -> Result<Vec<String>, String> {
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    let number = |w: &str, what: &str| w.parse::<u64>().map_err(|_| format!("WAIT needs a count and a time in ms, not {what} '{w}'"));
    let changes = &ctl.settings.changes;
    let n = match words[..] {
        [] => changes.count(),
        [seen] => changes.wait_past(number(seen, "count")?, WAIT_MOST),
        [seen, ms] => changes.wait_past(number(seen, "count")?, Duration::from_millis(number(ms, "time")?).min(WAIT_MOST)),
        _ => return Err("WAIT takes at most a count and a time in ms".into()),
    };
    Ok(vec![format!("changes {n}")])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Session<UnixStream>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (Session::new(a), b)
    }

    #[test]
    fn lines_split_across_reads_and_several_in_one_read() {
        let (mut s, mut peer) = pair();
        let far = Instant::now() + Duration::from_secs(5);
        let mut line = Vec::new();
        peer.write_all(b"SHOW\nLINK LI").unwrap();
        s.read_line(&mut line, |_| far).unwrap();
        assert_eq!(line, b"SHOW");
        peer.write_all(b"ST\r\n\n").unwrap();
        s.read_line(&mut line, |_| far).unwrap();
        assert_eq!(line, b"LINK LIST\r");
        s.read_line(&mut line, |_| far).unwrap();
        assert_eq!(line, b"");
        drop(peer);
        assert_eq!(s.read_line(&mut line, |_| far), Err(End::Closed));
    }

    #[test]
    fn a_line_longer_than_the_bound_ends_the_session() {
        let (mut s, mut peer) = pair();
        let far = Instant::now() + Duration::from_secs(5);
        let mut line = Vec::new();
        let mut exact = vec![b'x'; MAX_LINE];
        exact.push(b'\n');
        peer.write_all(&exact).unwrap();
        assert_eq!(s.read_line(&mut line, |_| far), Ok(()));
        let long = vec![b'x'; MAX_LINE + 100];
        peer.write_all(&long).unwrap();
        assert_eq!(s.read_line(&mut line, |_| far), Err(End::TooLong));
    }

    #[test]
    fn a_half_sent_line_times_out_at_its_deadline_not_the_idle_one() {
        let (mut s, mut peer) = pair();
        let mut line = Vec::new();
        let t0 = Instant::now();
        peer.write_all(b"ROUTE ADD any").unwrap();
        // Idle deadline far away, request deadline 150 ms after the first byte.
        let r = s.read_line(&mut line, |partial| match partial {
            Some(t) => t + Duration::from_millis(150),
            None => t0 + Duration::from_secs(60),
        });
        assert_eq!(r, Err(End::TimedOut));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(150) && took < Duration::from_secs(5), "{took:?}");
    }
}
