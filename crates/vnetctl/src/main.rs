//! vnetctl: sends control-language commands to a running vnetd and prints
//! the reply. Exits 0 on OK, 1 when vnetd refused the request, 2 when it
//! could not be reached.

use clap::Parser;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(version, about = "Send control commands to vnetd", after_help = "\
Examples:
  vnetctl ROUTE LIST
  vnetctl --tcp 127.0.0.1:9001 --token-file /etc/vnet/token LINK ADD 198.18.0.2
  vnetctl -f changes.conf        # the whole file, all or nothing
  vnetctl HELP                   # the control language")]
struct Args {
    /// vnetd's Unix control socket.
    #[arg(short, long, env = "VNETD_SOCKET", default_value = "/run/vnetd.sock")]
    socket: PathBuf,
    /// vnetd's control TCP address (instead of the Unix socket); needs
    /// --token-file.
    #[arg(short, long, env = "VNETD_TCP", requires = "token_file")]
    tcp: Option<String>,
    /// A file holding vnetd's control token (admin or read), for --tcp.
    #[arg(long, env = "VNETD_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Send this file ("-" for standard input) as one all-or-nothing request.
    #[arg(short, long, conflicts_with = "command")]
    file: Option<PathBuf>,
    /// The command, e.g. ROUTE LIST.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let request = match (&args.file, args.command.is_empty()) {
        (Some(p), _) => {
            let mut text = String::new();
            let read = if p.as_os_str() == "-" {
                std::io::stdin().read_to_string(&mut text).map(|_| ())
            } else {
                std::fs::read_to_string(p).map(|t| text = t)
            };
            if let Err(e) = read {
                eprintln!("vnetctl: cannot read {}: {e}", p.display());
                return ExitCode::from(2);
            }
            // The file is sent as one request; its own BEGIN/COMMIT would split it.
            if text.lines().any(|l| ["begin", "commit", "abort"].contains(&l.trim().to_ascii_lowercase().as_str())) {
                eprintln!("vnetctl: {} must not contain BEGIN, COMMIT or ABORT lines", p.display());
                return ExitCode::from(2);
            }
            format!("BEGIN\n{}\nCOMMIT\n", text.trim_end_matches('\n'))
        }
        (None, false) => format!("{}\n", args.command.join(" ")),
        (None, true) => {
            eprintln!("vnetctl: give a command (try: vnetctl HELP) or --file");
            return ExitCode::from(2);
        }
    };
    let result = match &args.tcp {
        Some(addr) => {
            // vnetd's TCP control asks every session for a token first.
            let p = args.token_file.as_ref().expect("clap requires --token-file with --tcp");
            let token = match std::fs::read_to_string(p) {
                Ok(t) => t.trim().to_string(),
                Err(e) => {
                    eprintln!("vnetctl: cannot read {}: {e}", p.display());
                    return ExitCode::from(2);
                }
            };
            let request = format!("AUTH {token}\n{request}");
            TcpStream::connect(addr)
                .map_err(|e| format!("cannot connect to vnetd at {addr}: {e}"))
                .and_then(|s| exchange(s.try_clone().map_err(|e| e.to_string())?, s, &request, true))
        }
        None => UnixStream::connect(&args.socket)
            .map_err(|e| {
                let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                    " (the control socket is for root, and for the group vnetd names with --control-group)"
                } else {
                    ""
                };
                format!("cannot connect to vnetd at {}: {e}{hint}", args.socket.display())
            })
            .and_then(|s| exchange(s.try_clone().map_err(|e| e.to_string())?, s, &request, false)),
    };
    match result {
        Ok(Ok(lines)) => {
            let mut out = std::io::stdout().lock();
            for l in lines {
                let _ = writeln!(out, "{l}");
            }
            ExitCode::SUCCESS
        }
        Ok(Err(e)) => {
            eprintln!("vnetctl: vnetd refused the request: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("vnetctl: {e}");
            ExitCode::from(2)
        }
    }
}

/// Sends the request and reads its one reply: `OK n` + n lines, or `ERR msg`
/// (after the reply to `AUTH` when `authenticating`).
fn exchange<R: Read, W: Write>(
    r: R,
    mut w: W,
    request: &str,
    authenticating: bool,
) -> Result<Result<Vec<String>, String>, String> {
    // vnetd may refuse a session (and close it) before reading a word of it:
    // its one-line reason is then the answer, not the broken pipe.
    let sent = w.write_all(request.as_bytes()).and_then(|_| w.flush());
    let mut r = BufReader::new(r);
    let reply = |r: &mut BufReader<R>| match (read_reply(r), &sent) {
        (Err(_), Err(e)) => Err(format!("send failed: {e}")),
        (reply, _) => reply,
    };
    if authenticating {
        match reply(&mut r)? {
            Ok(_) => {}
            Err(e) => return Ok(Err(e)),
        }
    }
    reply(&mut r)
}

fn read_reply<R: BufRead>(r: &mut R) -> Result<Result<Vec<String>, String>, String> {
    let mut status = String::new();
    if r.read_line(&mut status).map_err(|e| format!("receive failed: {e}"))? == 0 {
        return Err("vnetd closed the connection without replying".into());
    }
    let status = status.trim_end();
    if let Some(msg) = status.strip_prefix("ERR ") {
        return Ok(Err(msg.to_string()));
    }
    let n: usize = status
        .strip_prefix("OK ")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("unexpected reply '{status}'"))?;
    // The count is the server's word: no allocation is sized by it.
    let mut lines = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        let mut l = String::new();
        if r.read_line(&mut l).map_err(|e| format!("receive failed: {e}"))? == 0 {
            return Err("reply ended early".into());
        }
        lines.push(l.trim_end_matches(['\n', '\r']).to_string());
    }
    Ok(Ok(lines))
}
