//! A session with vnetd's control channel (docs/control-language.md, "The
//! wire protocol of the control channel"), for every program that speaks
//! it: vnetctl, vnet-agent and the CNI plugin.
//!
//! Over the Unix socket, or over TCP after `AUTH <token>`. A request is a
//! line, or `BEGIN`, lines, `COMMIT` (all or nothing); its reply is `OK <n>`
//! and n lines, or `ERR <message>`; once `FORMAT json` is accepted, each
//! reply is one line of JSON instead.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Where vnetd listens.
pub enum Target<'a> {
    Unix(&'a Path),
    Tcp { addr: &'a str, token: String },
}

/// Why a request did not go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// No answer: vnetd is not running, the socket is missing, the session
    /// broke, or the reply made no sense.
    Unreachable(String),
    /// vnetd answered `ERR`: its reason (nothing was changed).
    Refused(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Error::Unreachable(m) => f.write_str(m),
            Error::Refused(m) => write!(f, "vnetd refused the request: {m}"),
        }
    }
}

impl std::error::Error for Error {}

pub struct Session {
    r: BufReader<Box<dyn Read + Send>>,
    w: Box<dyn Write + Send>,
    /// The first write's failure: vnetd may refuse a session before reading
    /// a word of it, and its one-line reason is then the answer.
    send_error: Option<std::io::Error>,
}

impl Session {
    /// Connects (and authenticates on TCP). `timeout` bounds each read, so
    /// a vnetd that accepts but never answers cannot hang the caller.
    pub fn open(target: &Target, timeout: Option<Duration>) -> Result<Session, Error> {
        let (r, w): (Box<dyn Read + Send>, Box<dyn Write + Send>) = match target {
            Target::Unix(path) => {
                let broken = |e: std::io::Error| {
                    let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                        " (the control socket is for root, and for the group vnetd names with --control-group)"
                    } else {
                        ""
                    };
                    Error::Unreachable(format!("cannot connect to vnetd at {}: {e}{hint}", path.display()))
                };
                let s = UnixStream::connect(path).map_err(broken)?;
                s.set_read_timeout(timeout).map_err(broken)?;
                (Box::new(s.try_clone().map_err(broken)?), Box::new(s))
            }
            Target::Tcp { addr, .. } => {
                let broken = |e: std::io::Error| Error::Unreachable(format!("cannot connect to vnetd at {addr}: {e}"));
                let s = TcpStream::connect(addr).map_err(broken)?;
                let _ = s.set_nodelay(true);
                s.set_read_timeout(timeout).map_err(broken)?;
                (Box::new(s.try_clone().map_err(broken)?), Box::new(s))
            }
        };
        let mut s = Session { r: BufReader::new(r), w, send_error: None };
        if let Target::Tcp { token, .. } = target {
            s.send(&format!("AUTH {token}"));
            s.read_text()?;
        }
        Ok(s)
    }

    /// A session on vnetd's Unix socket.
    pub fn unix(path: &Path, timeout: Option<Duration>) -> Result<Session, Error> {
        Session::open(&Target::Unix(path), timeout)
    }

    /// Writes a request (a newline is added if it lacks one) without
    /// waiting for its reply; a failure shows when the reply is read.
    pub fn send(&mut self, text: &str) {
        if self.send_error.is_none() {
            let nl: &[u8] = if text.ends_with('\n') { b"" } else { b"\n" };
            let sent = self.w.write_all(text.as_bytes()).and_then(|_| self.w.write_all(nl)).and_then(|_| self.w.flush());
            if let Err(e) = sent {
                self.send_error = Some(e);
            }
        }
    }

    fn line(&mut self) -> Result<String, Error> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) | Err(_) if self.send_error.is_some() => {
                Err(Error::Unreachable(format!("send failed: {}", self.send_error.as_ref().expect("checked"))))
            }
            Ok(0) => Err(Error::Unreachable("vnetd closed the connection without replying".into())),
            Err(e) => Err(Error::Unreachable(format!("receive failed: {e}"))),
            Ok(_) => Ok(l.trim_end_matches(['\n', '\r']).to_string()),
        }
    }

    /// Reads a text reply: its lines, or vnetd's reason for refusing.
    pub fn read_text(&mut self) -> Result<Vec<String>, Error> {
        let status = self.line()?;
        if let Some(msg) = status.strip_prefix("ERR ") {
            return Err(Error::Refused(msg.to_string()));
        }
        let n: usize = status
            .strip_prefix("OK ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::Unreachable(format!("unexpected reply '{status}'")))?;
        // The count is the server's word: no allocation is sized by it.
        let mut lines = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            lines.push(self.line().map_err(|_| Error::Unreachable("the reply ended early".into()))?);
        }
        Ok(lines)
    }

    /// One request and its text reply.
    pub fn request(&mut self, text: &str) -> Result<Vec<String>, Error> {
        self.send(text);
        self.read_text()
    }

    /// `lines` as one request: all of them, or (if vnetd refuses one) none.
    pub fn apply(&mut self, lines: &[String]) -> Result<Vec<String>, Error> {
        let mut text = String::from("BEGIN\n");
        for l in lines {
            text.push_str(l);
            text.push('\n');
        }
        text.push_str("COMMIT\n");
        self.request(&text)
    }

    /// Asks for JSON replies from now on. A vnetd older than `FORMAT`
    /// answers in text that it does not know the command: that is said
    /// plainly, as a refusal.
    pub fn want_json(&mut self) -> Result<(), Error> {
        self.send("FORMAT json");
        let first = self.line()?;
        if first.starts_with('{') {
            let v: serde_json::Value =
                serde_json::from_str(&first).map_err(|e| Error::Unreachable(format!("unexpected reply '{first}': {e}")))?;
            return if v["ok"] == true { Ok(()) } else { Err(Error::Refused(v["error"].as_str().unwrap_or("refused").to_string())) };
        }
        let why = first.strip_prefix("ERR ").unwrap_or(&first);
        if !why.contains("unknown command") {
            return Err(Error::Refused(why.to_string()));
        }
        Err(Error::Refused(format!(
            "this vnetd cannot reply in JSON (it is older than this client, version {}): it answered FORMAT json with: {why}",
            env!("CARGO_PKG_VERSION")
        )))
    }

    /// Reads a JSON reply: its records, or vnetd's reason for refusing.
    pub fn read_json(&mut self) -> Result<serde_json::Value, Error> {
        let l = self.line()?;
        let v: serde_json::Value =
            serde_json::from_str(&l).map_err(|e| Error::Unreachable(format!("unexpected reply '{l}': {e}")))?;
        if v["ok"] == true {
            Ok(v["records"].clone())
        } else {
            Err(Error::Refused(v["error"].as_str().unwrap_or("refused").to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A vnetd stand-in that answers each line it reads with `replies`'s next.
    fn server(replies: Vec<&'static str>) -> (tempdir::Dir, std::thread::JoinHandle<Vec<String>>) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        let h = std::thread::spawn(move || {
            let (c, _) = l.accept().unwrap();
            let mut r = BufReader::new(c.try_clone().unwrap());
            let mut w = c;
            let mut got = Vec::new();
            for reply in replies {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                got.push(line.trim_end().to_string());
                w.write_all(reply.as_bytes()).unwrap();
            }
            got
        });
        (dir, h)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p = std::env::temp_dir().join(format!("vnet-client-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn text_replies_refusals_and_nonsense() {
        let (dir, h) = server(vec!["OK 2\na\nb\n", "ERR line 1: no\n", "HELLO\n"]);
        let mut s = Session::unix(&dir.0.join("s.sock"), Some(Duration::from_secs(5))).unwrap();
        assert_eq!(s.request("LINK LIST").unwrap(), vec!["a", "b"]);
        assert_eq!(s.request("LINK DEL x\n"), Err(Error::Refused("line 1: no".into())));
        assert!(matches!(s.request("SHOW"), Err(Error::Unreachable(m)) if m.contains("HELLO")));
        assert_eq!(h.join().unwrap(), vec!["LINK LIST", "LINK DEL x", "SHOW"]);
    }

    #[test]
    fn a_count_larger_than_the_reply_is_an_early_end_not_a_hang() {
        let (dir, h) = server(vec!["OK 1000000000\nonly\n"]);
        let mut s = Session::unix(&dir.0.join("s.sock"), Some(Duration::from_secs(5))).unwrap();
        s.send("STATS");
        drop(h.join());
        assert_eq!(s.read_text(), Err(Error::Unreachable("the reply ended early".into())));
    }

    #[test]
    fn json_and_an_older_vnetds_refusal() {
        let (dir, h) = server(vec!["{\"ok\":true,\"records\":[]}\n", "{\"ok\":true,\"records\":[{\"kind\":\"link\"}]}\n"]);
        let mut s = Session::unix(&dir.0.join("s.sock"), None).unwrap();
        s.want_json().unwrap();
        s.send("LINK LIST");
        assert_eq!(s.read_json().unwrap()[0]["kind"], "link");
        drop(h.join());
        let (dir, _h) = server(vec!["ERR line 1: unknown command 'FORMAT json' (try HELP): FORMAT json\n"]);
        let mut s = Session::unix(&dir.0.join("s.sock"), None).unwrap();
        assert!(matches!(s.want_json(), Err(Error::Refused(m)) if m.contains("older than this client")));
    }
}
