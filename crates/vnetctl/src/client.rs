//! A control session with vnetd: over its Unix socket, or over TCP after
//! `AUTH <token>`; replies in text (`OK n` + n lines, or `ERR msg`) or, once
//! `FORMAT json` is accepted, one line of JSON each.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Where vnetd listens.
pub enum Target<'a> {
    Unix(&'a Path),
    Tcp { addr: &'a str, token: String },
}

/// Why a request got no answer (as opposed to a refusal, which is an
/// answer).
#[derive(Debug)]
pub struct Unreachable(pub String);

pub struct Session {
    r: BufReader<Box<dyn std::io::Read>>,
    w: Box<dyn Write>,
    /// The first write's failure: vnetd may refuse a session before reading
    /// a word of it, and its one-line reason is then the answer.
    send_error: Option<std::io::Error>,
}

impl Session {
    pub fn connect(target: &Target) -> Result<Session, Unreachable> {
        let (r, w): (Box<dyn std::io::Read>, Box<dyn Write>) = match target {
            Target::Unix(path) => {
                let s = UnixStream::connect(path).map_err(|e| {
                    let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                        " (the control socket is for root, and for the group vnetd names with --control-group)"
                    } else {
                        ""
                    };
                    Unreachable(format!("cannot connect to vnetd at {}: {e}{hint}", path.display()))
                })?;
                let r = s.try_clone().map_err(|e| Unreachable(e.to_string()))?;
                (Box::new(r), Box::new(s))
            }
            Target::Tcp { addr, .. } => {
                let s = TcpStream::connect(addr).map_err(|e| Unreachable(format!("cannot connect to vnetd at {addr}: {e}")))?;
                let _ = s.set_nodelay(true);
                let r = s.try_clone().map_err(|e| Unreachable(e.to_string()))?;
                (Box::new(r), Box::new(s))
            }
        };
        Ok(Session { r: BufReader::new(r), w, send_error: None })
    }

    /// Connects, and authenticates on TCP: Err(Ok(refusal)) when vnetd
    /// turned the session away.
    pub fn open(target: &Target) -> Result<Result<Session, String>, Unreachable> {
        let mut s = Session::connect(target)?;
        if let Target::Tcp { token, .. } = target {
            s.send(&format!("AUTH {token}\n"));
            if let Err(refused) = s.read_text()? {
                return Ok(Err(refused));
            }
        }
        Ok(Ok(s))
    }

    /// Writes without waiting for the reply (a failure shows when the
    /// reply is read).
    pub fn send(&mut self, text: &str) {
        if self.send_error.is_none() {
            if let Err(e) = self.w.write_all(text.as_bytes()).and_then(|_| self.w.flush()) {
                self.send_error = Some(e);
            }
        }
    }

    fn line(&mut self) -> Result<String, Unreachable> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) | Err(_) if self.send_error.is_some() => {
                Err(Unreachable(format!("send failed: {}", self.send_error.as_ref().expect("checked"))))
            }
            Ok(0) => Err(Unreachable("vnetd closed the connection without replying".into())),
            Err(e) => Err(Unreachable(format!("receive failed: {e}"))),
            Ok(_) => Ok(l.trim_end_matches(['\n', '\r']).to_string()),
        }
    }

    /// Reads a text reply: the lines, or vnetd's reason for refusing.
    pub fn read_text(&mut self) -> Result<Result<Vec<String>, String>, Unreachable> {
        let status = self.line()?;
        if let Some(msg) = status.strip_prefix("ERR ") {
            return Ok(Err(msg.to_string()));
        }
        let n: usize = status
            .strip_prefix("OK ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Unreachable(format!("unexpected reply '{status}'")))?;
        // The count is the server's word: no allocation is sized by it.
        let mut lines = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            lines.push(self.line().map_err(|_| Unreachable("reply ended early".into()))?);
        }
        Ok(Ok(lines))
    }

    /// Asks for JSON replies: Err(reason) when this vnetd cannot give them
    /// (one older than FORMAT answers in text that it does not know it).
    pub fn want_json(&mut self) -> Result<Result<(), String>, Unreachable> {
        self.send("FORMAT json\n");
        let first = self.line()?;
        if first.starts_with('{') {
            return match serde_json::from_str::<serde_json::Value>(&first) {
                Ok(v) if v["ok"] == true => Ok(Ok(())),
                Ok(v) => Ok(Err(v["error"].as_str().unwrap_or("refused").to_string())),
                Err(e) => Err(Unreachable(format!("unexpected reply '{first}': {e}"))),
            };
        }
        let why = first.strip_prefix("ERR ").unwrap_or(&first);
        if !why.contains("unknown command") {
            return Ok(Err(why.to_string()));
        }
        Ok(Err(format!("this vnetd cannot reply in JSON (it is older than this vnetctl, version {}): it answered FORMAT json with: {why}", env!("CARGO_PKG_VERSION"))))
    }

    /// Reads a JSON reply: Ok(records) or Err(vnetd's reason).
    pub fn read_json(&mut self) -> Result<Result<serde_json::Value, String>, Unreachable> {
        let l = self.line()?;
        let v: serde_json::Value = serde_json::from_str(&l).map_err(|e| Unreachable(format!("unexpected reply '{l}': {e}")))?;
        if v["ok"] == true {
            Ok(Ok(v["records"].clone()))
        } else {
            Ok(Err(v["error"].as_str().unwrap_or("refused").to_string()))
        }
    }
}
