//! vnetctl: sends control-language commands to a running vnetd and prints
//! the reply, as text or (`-j`, `-p`) JSON; `vnetctl top` is a live view of
//! the traffic. Exits 0 on OK, 1 when vnetd refused the request, 2 when it
//! could not be reached.

mod top;

use clap::{CommandFactory, Parser};
use vnet_client::{Error, Session, Target};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(version, about = "Send control commands to vnetd", after_help = "\
Examples:
  vnetctl ROUTE LIST
  vnetctl -p STATS interfaces    # as JSON, indented
  vnetctl top                    # frames/s, Gbit/s and drops, live
  vnetctl --tcp 127.0.0.1:9001 --token-file /etc/vnet/token LINK ADD 198.18.0.2
  vnetctl -f changes.conf        # the whole file, all or nothing
  vnetctl HELP                   # the control language")]
pub struct Args {
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
    /// Print the reply as JSON: the records (an array), or {"error": ...}.
    #[arg(short, long)]
    json: bool,
    /// Print the reply as indented JSON.
    #[arg(short, long)]
    pretty: bool,
    /// Print a completion script for this shell and exit.
    #[arg(long, value_name = "SHELL")]
    completions: Option<clap_complete::Shell>,
    /// Print vnetctl's manual page (roff) and exit.
    #[arg(long)]
    man: bool,
    /// The command, e.g. ROUTE LIST; or `top [-i <seconds>] [-n <count>]`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(shell) = args.completions {
        clap_complete::generate(shell, &mut Args::command(), "vnetctl", &mut std::io::stdout());
        return ExitCode::SUCCESS;
    }
    if args.man {
        return match clap_mangen::Man::new(Args::command()).render(&mut std::io::stdout()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(2, &format!("cannot write the manual page: {e}"), None),
        };
    }
    let json = args.json || args.pretty;
    let target = match &args.tcp {
        Some(addr) => {
            // vnetd's TCP control asks every session for a token first.
            let p = args.token_file.as_ref().expect("clap requires --token-file with --tcp");
            match std::fs::read_to_string(p) {
                Ok(t) => Target::Tcp { addr, token: t.trim().to_string() },
                Err(e) => {
                    let e = format!("cannot read {}: {e}", p.display());
                    return fail(2, &e, json.then_some(&e));
                }
            }
        }
        None => Target::Unix(&args.socket),
    };
    if args.command.first().is_some_and(|c| c.eq_ignore_ascii_case("top")) {
        let top = top::Args::parse_from(std::iter::once("vnetctl top").chain(args.command[1..].iter().map(String::as_str)));
        return match top::run(&target, top.interval, top.count) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e @ Error::Refused(_)) => fail(1, &e.to_string(), None),
            Err(Error::Unreachable(e)) => fail(2, &e, None),
        };
    }
    let request = match request(&args) {
        Ok(r) => r,
        Err(e) => return fail(2, &e, json.then_some(&e)),
    };
    match exchange(&target, &request, json) {
        Ok(out) => {
            let mut stdout = std::io::stdout().lock();
            let text = match out {
                Reply::Text(lines) => lines.into_iter().map(|l| l + "\n").collect::<String>(),
                Reply::Json(v) if args.pretty => serde_json::to_string_pretty(&v).expect("JSON value") + "\n",
                Reply::Json(v) => v.to_string() + "\n",
            };
            let _ = stdout.write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(Error::Refused(e)) => fail(1, &format!("vnetd refused the request: {e}"), json.then_some(&e)),
        Err(Error::Unreachable(e)) => fail(2, &e, json.then_some(&e)),
    }
}

/// Says why on stderr (and, for JSON, `{"error": ...}` on stdout with
/// vnetd's words or ours), and exits with `code`.
fn fail(code: u8, msg: &str, json: Option<&str>) -> ExitCode {
    eprintln!("vnetctl: {msg}");
    if let Some(e) = json {
        println!("{}", serde_json::json!({ "error": e }));
    }
    ExitCode::from(code)
}

/// The request the command line asks for, as sent.
fn request(args: &Args) -> Result<String, String> {
    match (&args.file, args.command.is_empty()) {
        (Some(p), _) => {
            let mut text = String::new();
            let read = if p.as_os_str() == "-" {
                std::io::stdin().read_to_string(&mut text).map(|_| ())
            } else {
                std::fs::read_to_string(p).map(|t| text = t)
            };
            read.map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            // The file is sent as one request; its own BEGIN/COMMIT would split it.
            if text.lines().any(|l| ["begin", "commit", "abort", "format"].contains(&l.split_whitespace().next().unwrap_or("").to_ascii_lowercase().as_str())) {
                return Err(format!("{} must not contain BEGIN, COMMIT, ABORT or FORMAT lines", p.display()));
            }
            Ok(format!("BEGIN\n{}\nCOMMIT\n", text.trim_end_matches('\n')))
        }
        (None, false) => Ok(format!("{}\n", args.command.join(" "))),
        (None, true) => Err("give a command (try: vnetctl HELP) or --file".into()),
    }
}

enum Reply {
    Text(Vec<String>),
    Json(serde_json::Value),
}

/// Sends the request and reads its one reply. No read timeout: a request
/// may take as long as vnetd needs (a large config, say).
fn exchange(target: &Target, request: &str, json: bool) -> Result<Reply, Error> {
    let mut s = Session::open(target, None)?;
    if json {
        s.want_json()?;
        s.send(request);
        return s.read_json().map(Reply::Json);
    }
    s.send(request);
    s.read_text().map(Reply::Text)
}
