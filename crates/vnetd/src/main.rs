//! vnetd: one per host. Gives each guest its virtual NIC (TAP, veth,
//! vhost-user), routes the guests' Ethernet frames by MAC through the rule
//! table, and carries them to other hosts' vnetd over links (UDP, VXLAN,
//! TCP, direct), in the kernel's eBPF fast path where it can and in its own
//! dispatchers otherwise; carries guests' TCP connections whole (VTOE).
//! Configured with the control language from a file at start and over TCP or
//! a Unix socket while it runs. The daemon is the `vnetd` library; this is
//! its command line.

use clap::{CommandFactory, Parser};
use vnetd::daemon::{run, Args, LogFormat};

fn main() {
    vnet_sys::process::abort_on_panic();
    let args = Args::parse();
    if let Some(shell) = args.completions {
        clap_complete::generate(shell, &mut Args::command(), "vnetd", &mut std::io::stdout());
        return;
    }
    if args.man {
        if let Err(e) = clap_mangen::Man::new(Args::command()).section("8").render(&mut std::io::stdout()) {
            eprintln!("vnetd: cannot write the manual page: {e}");
            std::process::exit(1);
        }
        return;
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // boringtun's own warnings (handshake retries) are WireGuard's
        // routine; its errors stay (RUST_LOG=boringtun=debug shows all).
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{},boringtun=error", args.log_level)));
    let log = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    match args.log_format {
        LogFormat::Text => log.init(),
        LogFormat::Json => log.json().flatten_event(true).with_current_span(false).init(),
    }
    if let Err(e) = run(args) {
        eprintln!("vnetd: {e:#}");
        std::process::exit(1);
    }
}

