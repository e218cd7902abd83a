//! `vnetctl top`: what each interface and link carries now (frames/s and
//! Gbit/s each way, the share the kernel fast path took), which path and
//! dispatch mode each interface runs, and drops by reason, refreshed like
//! `iftop`/`bmon`. One session, in JSON, reads the counters every interval;
//! rates are differences between two readings over the time between them.

use vnet_client::{Error, Session, Target};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// `vnetctl top`'s own options.
#[derive(clap::Parser, Debug)]
#[command(about = "Live view of vnetd's traffic")]
pub struct Args {
    /// Seconds between refreshes.
    #[arg(short, long, default_value_t = 1.0, value_parser = parse_interval)]
    pub interval: f64,
    /// Stop after this many refreshes (default: until interrupted).
    #[arg(short = 'n', long)]
    pub count: Option<u64>,
}

pub fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.05..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not an interval in seconds (0.05 to 3600)")),
    }
}

/// One reading of vnetd's counters.
struct Reading {
    at: Instant,
    /// STATS global's records (global, paths, fastpath, ...) by kind.
    global: BTreeMap<String, Value>,
    /// Per-port counters (`interface`/`link` records of STATS) by (kind, id).
    ports: BTreeMap<(String, u64), Value>,
    /// Listings (`INTERFACE LIST`, `LINK LIST`) by (kind, id).
    listed: BTreeMap<(String, u64), Value>,
}

const REQUEST: &str = "STATS global\nSTATS interfaces\nSTATS links\nINTERFACE LIST\nLINK LIST\n";

fn read(s: &mut Session) -> Result<Reading, Error> {
    s.send(REQUEST);
    let mut replies = Vec::new();
    for _ in 0..5 {
        replies.push(s.read_json()?);
    }
    let at = Instant::now();
    let records = |v: &Value| v.as_array().cloned().unwrap_or_default();
    let key = |r: &Value| (r["kind"].as_str().unwrap_or("").to_string(), r["id"].as_u64().unwrap_or(0));
    let global = records(&replies[0]).into_iter().map(|r| (r["kind"].as_str().unwrap_or("").to_string(), r)).collect();
    let ports = replies[1..3].iter().flat_map(records).map(|r| (key(&r), r)).collect();
    let listed = replies[3..5].iter().flat_map(records).map(|r| (key(&r), r)).collect();
    Ok(Reading { at, global, ports, listed })
}

pub fn run(target: &Target, interval: f64, count: Option<u64>) -> Result<(), Error> {
    let mut s = Session::open(target, Some(Duration::from_secs(30)))?;
    s.want_json()?;
    let tty = std::io::stdout().is_terminal();
    let mut before = read(&mut s)?;
    let mut shown = 0;
    while count.is_none_or(|c| shown < c) {
        std::thread::sleep(Duration::from_secs_f64(interval));
        let now = read(&mut s)?;
        let mut screen = String::new();
        if tty {
            screen.push_str("\x1b[H\x1b[2J");
        } else if shown > 0 {
            screen.push('\n');
        }
        render(&before, &now, interval, &mut screen);
        let mut out = std::io::stdout().lock();
        if out.write_all(screen.as_bytes()).and_then(|_| out.flush()).is_err() {
            return Ok(()); // the reader went away (e.g. `| head`)
        }
        before = now;
        shown += 1;
    }
    Ok(())
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or("-")
}

/// Rates between two readings, as the screen shows them.
fn render(a: &Reading, b: &Reading, interval: f64, out: &mut String) {
    let dt = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
    let rate = |k: &str, x: &Value, y: &Value| n(y, k).saturating_sub(n(x, k)) as f64 / dt;
    let fast = &b.global.get("fastpath").cloned().unwrap_or(Value::Null);
    let datapath = match (s(fast, "loaded"), s(fast, "enabled")) {
        ("yes", "yes") => "kernel fast path + vnetd",
        ("yes", _) => "vnetd only (fast path off)",
        _ => "vnetd only (fast path not loaded)",
    };
    let _ = writeln!(out, "vnetctl top: every {interval} s; datapath: {datapath}");
    let _ = writeln!(
        out,
        "{:<6} {:<16} {:<10} {:<7} {:<13} {:>11} {:>9} {:>11} {:>9} {:>6} {:>9}",
        "PORT", "NAME", "KIND", "PATH", "MODE", "IN fr/s", "IN Gb/s", "OUT fr/s", "OUT Gb/s", "FAST%", "DROPS/s"
    );
    for ((kind, id), y) in &b.ports {
        let null = Value::Null;
        let x = a.ports.get(&(kind.clone(), *id)).unwrap_or(&null);
        let listed = b.listed.get(&(kind.clone(), *id)).unwrap_or(&null);
        let (what, path, mode) = if kind == "interface" {
            let path = listed["path"].as_str().unwrap_or(if s(listed, "attach") == "vhost-user" { "vhost" } else { "user" });
            (s(listed, "attach"), path, s(y, "running"))
        } else {
            (s(listed, "proto"), "", "")
        };
        let frames = rate("in_frames", x, y) + rate("out_frames", x, y);
        let fast_frames = rate("fast_in_frames", x, y) + rate("fast_out_frames", x, y);
        let fast_share = if frames > 0.0 { format!("{:.0}", 100.0 * fast_frames / frames) } else { "-".into() };
        let drops: f64 = y
            .as_object()
            .map(|o| o.keys().filter(|k| k.starts_with("drop_")).map(|k| rate(k, x, y)).sum())
            .unwrap_or(0.0);
        let _ = writeln!(
            out,
            "{:<6} {:<16} {:<10} {:<7} {:<13} {:>11.0} {:>9.3} {:>11.0} {:>9.3} {:>6} {:>9.0}",
            format!("{}{id}", &kind[..1]),
            s(y, "name"),
            what,
            path,
            mode,
            rate("in_frames", x, y),
            rate("in_bytes", x, y) * 8.0 / 1e9,
            rate("out_frames", x, y),
            rate("out_bytes", x, y) * 8.0 / 1e9,
            fast_share,
            drops
        );
    }
    // Drops by reason over the whole daemon, the fast path's own included.
    let mut reasons = Vec::new();
    for kind in ["global", "fastpath"] {
        let (Some(x), Some(y)) = (a.global.get(kind), b.global.get(kind)) else { continue };
        for k in y.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default() {
            if k.starts_with("drop_") {
                let r = rate(&k, x, y);
                if r > 0.0 {
                    reasons.push(format!("{}{}={r:.0}/s", if kind == "fastpath" { "fast_" } else { "" }, &k[5..]));
                }
            }
        }
    }
    let upcall: f64 = b.ports.iter().map(|(k, y)| rate("drop_upcall_full", a.ports.get(k).unwrap_or(&Value::Null), y)).sum();
    if upcall > 0.0 {
        reasons.push(format!("upcall_full={upcall:.0}/s"));
    }
    let _ = writeln!(out, "drops: {}", if reasons.is_empty() { "none".to_string() } else { reasons.join(" ") });
}
