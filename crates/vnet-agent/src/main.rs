//! vnet-agent: one per host, beside its vnetd. It registers the host in etcd
//! on a lease, publishes the guests its vnetd has, watches everyone else's,
//! and keeps its vnetd's links and routes equal to what the published state
//! implies (`model`). It is an ordinary admin client of vnetd: routes a user
//! added by hand are never touched, and if the agent or etcd stops, vnetd
//! goes on forwarding with the routes it has. docs/controller.md has the
//! keys, the rules and the failure handling.

mod model;
mod store;
mod vnetd;

use anyhow::Result;
use clap::Parser;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug, Clone)]
#[command(version, about = "VNET's per-host agent: links and routes derived from etcd")]
pub struct Args {
    /// etcd endpoints, comma-separated (http://127.0.0.1:2379 or https://...).
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// This host's name in the overlay (unique).
    #[arg(long)]
    host: String,
    /// The address other hosts' vnetds reach this one's links at.
    #[arg(long)]
    underlay: IpAddr,
    /// The UDP port of this host's vnetd links (vnetd --udp-port).
    #[arg(long, default_value_t = 9000)]
    port: u16,
    /// This host's vnetd control socket.
    #[arg(long, default_value = "/run/vnetd.sock", env = "VNETD_SOCKET")]
    socket: PathBuf,
    /// Key prefix in etcd (several overlays can share one etcd).
    #[arg(long, default_value = "/vnet")]
    prefix: String,
    /// Seconds this host's registration lives without the agent: after it,
    /// the other hosts withdraw its guests.
    #[arg(long, default_value_t = 5)]
    ttl: i64,
    /// How often the agent reads its vnetd's interfaces (milliseconds).
    #[arg(long, default_value_t = 200)]
    interval_ms: u64,
    /// CA certificate for etcd over TLS.
    #[arg(long)]
    cacert: Option<PathBuf>,
    /// Client certificate and key for etcd over TLS.
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides).
    #[arg(long, default_value = "info")]
    log_level: String,
}

fn main() {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&args.log_level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    if let Err(e) = rt.block_on(run(args)) {
        eprintln!("vnet-agent: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<()> {
    model::check_host_name(&args.host)?;
    let mut vnetd = vnetd::Vnetd::new(&args.socket);
    let mut store = store::Store::new(&args).await;
    let mut tick = tokio::time::interval(Duration::from_millis(args.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tracing::info!("vnet-agent for host {} ({}:{}), etcd {}", args.host, args.underlay, args.port, args.etcd.join(","));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = store.next_event() => {}
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
        // Drain every event that is already there before deciding.
        store.drain().await;
        store.maintain().await;
        let state = match vnetd.state() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("vnetd at {}: {e:#}", args.socket.display());
                continue;
            }
        };
        let local: BTreeMap<String, (u32, String)> = state.ifaces.clone();
        store.publish(&local).await;
        let Some(view) = store.view() else { continue };
        let held = store.held(&local);
        let want = model::derive(&args.host, view.hosts, view.guests, &held);
        let changes = model::plan(&want, &state.links, &state.routes, &state.user_routes);
        if changes.is_empty() {
            continue;
        }
        match vnetd.apply(&changes) {
            Ok(_) => {
                tracing::info!(
                    "applied {} change(s) at etcd revision {}: {} routes, {} links of ours",
                    changes.len(),
                    view.revision,
                    want.routes.len(),
                    want.links.len()
                );
            }
            Err(e) => tracing::warn!("vnetd refused the agent's changes: {e:#}"),
        }
    }
    // The lease is left to expire rather than revoked: an agent restarted
    // within its TTL takes its keys back and no other host notices.
    tracing::info!("vnet-agent stopped; vnetd keeps its routes (other hosts keep ours for {} s)", args.ttl);
    Ok(())
}
