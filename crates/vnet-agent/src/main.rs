//! vnet-agent: one per host, beside its vnetd. It registers the host in etcd
//! on a lease, publishes the guests its vnetd has, watches everyone else's,
//! and keeps its vnetd's links and routes equal to what the published state
//! implies (`model`). It is an ordinary admin client of vnetd: routes a user
//! added by hand are never touched, and if the agent or etcd stops, vnetd
//! goes on forwarding with the routes it has. docs/controller.md has the
//! keys, the rules and the failure handling.

mod auth;
mod etcd;
mod lease;
mod model;
mod passes;
mod records;
mod show;
mod store;
mod vnetd;

use anyhow::Result;
use etcd::EtcdArgs;
use clap::Parser;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A full pass (links and routes read and compared) at least this often.
/// Every change vnetd commits (anyone's: a user's too) wakes the agent
/// through `WAIT` for a full pass at once, and every change in etcd through
/// its watch; this is only the safety net, so an idle overlay costs the
/// agent almost nothing (docs/controller.md, "At scale").
const RESYNC: Duration = Duration::from_secs(60);

/// The least time between two passes woken by etcd's events: a burst of
/// events is drained into one pass, not one pass each (on a loaded machine
/// the gap grows with the passes' own time, below). 10 ms, not more: a
/// migration is two events about 25 ms apart (the old host's release, the
/// new host's claim), and the second waited out a 100 ms gap: the VM's
/// re-route took 93 ms from its rings' start, not 17 (tests/test_migration.py).
const PASS_GAP: Duration = Duration::from_millis(10);

#[derive(Parser, Debug)]
#[command(version, about = "VNET's per-host agent: links and routes derived from etcd")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides).
    #[arg(long, default_value = "info", global = true)]
    log_level: String,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Run the agent for this host (beside its vnetd).
    Run(Args),
    /// Show the overlay as etcd holds it: hosts, networks, guests, and the
    /// traffic between hosts and between guests.
    Show(show::ShowArgs),
    /// Provision etcd's users and roles, so each host's agent writes only
    /// its own records.
    Auth(auth::AuthArgs),
    /// Release a host's claims of guests' MACs (for a host gone for good:
    /// its guests' MACs are held by nobody until then).
    Release(show::ReleaseArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// This host's name in the overlay (unique).
    #[arg(long)]
    pub host: String,
    /// The address other hosts' vnetds reach this one's links at.
    #[arg(long)]
    pub underlay: IpAddr,
    /// The UDP port of this host's vnetd links (vnetd --udp-port).
    #[arg(long, default_value_t = 9000)]
    pub port: u16,
    /// This host's vnetd control socket.
    #[arg(long, default_value = "/run/vnetd.sock", env = "VNETD_SOCKET")]
    pub socket: PathBuf,
    /// Seconds this host's registration lives without the agent: after it,
    /// the other hosts withdraw its guests.
    #[arg(long, default_value_t = 5)]
    pub ttl: i64,
    /// How often the agent asks its vnetd whether anything changed
    /// (milliseconds; one short request, the tables read only if so),
    /// besides at once whenever vnetd reports a change (`WAIT`), which is
    /// how changes are seen: this is the safety net.
    #[arg(long, default_value_t = 10_000)]
    pub interval_ms: u64,
    /// How often the agent publishes its routes' traffic counters, when
    /// they changed (seconds; 0: never, the default). Every agent watches
    /// the overlay's prefix, so each such write is an event to every host:
    /// H hosts writing every T seconds cost etcd H²/T events a second (at
    /// 1,000 hosts and 5 s, 200,000): for `vnet-agent show`'s traffic
    /// matrix on small overlays, not for 1,000 hosts.
    #[arg(long, default_value_t = 0)]
    pub traffic_s: u64,
    /// A file the agent keeps listing every guest the overlay holds, one
    /// `<mac> <host> <network>` a line: vnet-cni's `macsFile`, so that a
    /// container is never given a MAC another guest holds.
    #[arg(long)]
    pub macs_file: Option<PathBuf>,
    /// Encrypt between hosts: publish this host's WireGuard public key (its
    /// vnetd's, which needs --wireguard-key-file) and link to the other
    /// encrypting hosts by WireGuard. A host that publishes no key gets no
    /// link from this one (never a link in clear).
    #[arg(long)]
    pub encrypt: bool,
    /// A migration's hand-over window (milliseconds): a claim that missed
    /// its holder's release (the new host claimed before the old one let
    /// go) and was written in etcd less than this before the MAC came
    /// free, is made again. A claim older than this that waited behind a
    /// holder never takes the MAC. 30 s: an old host's release can take
    /// that long when etcd is overloaded (bench/scale.py's churn at 1,000
    /// hosts on two CPUs: 36 s), and a claim made that close to a
    /// migration is not one made ahead of time to take it. Also how long
    /// a release keeps its guest's addresses for a host yet to claim it.
    #[arg(long, default_value_t = 30_000)]
    pub handover_ms: u64,
}

fn main() {
    vnet_sys::process::abort_on_panic();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log_level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let done = match cli.cmd {
        Cmd::Run(args) => rt.block_on(run(args)),
        Cmd::Show(args) => rt.block_on(show::show(args)),
        Cmd::Auth(args) => rt.block_on(auth::auth(args)),
        Cmd::Release(args) => rt.block_on(show::release(args)),
    };
    if let Err(e) = done {
        eprintln!("vnet-agent: {e:#}");
        std::process::exit(1);
    }
}

/// Writes the overlay's guests to `file` (a new file renamed over the old,
/// so a reader sees one or the other whole) when they changed.
fn write_macs(file: &std::path::Path, guests: &BTreeMap<String, model::Guest>, last: &mut Option<String>) {
    let text: String = guests.iter().map(|(m, g)| format!("{m} {} {}\n", g.host, g.network)).collect();
    if last.as_ref() == Some(&text) {
        return;
    }
    let tmp = file.with_extension("new");
    match std::fs::write(&tmp, &text).and_then(|_| std::fs::rename(&tmp, file)) {
        Ok(()) => *last = Some(text),
        Err(e) => tracing::warn!("cannot write {}: {e}", file.display()),
    }
}

/// vnetd's WireGuard port and public key (`SHOW`), waiting for vnetd to
/// answer; an error if it has no WireGuard key.
async fn wireguard_of(vnetd: &mut vnetd::Vnetd, socket: &std::path::Path) -> Result<(u16, String)> {
    loop {
        match vnetd.request("SHOW") {
            Ok(lines) => {
                return vnetd::parse_wireguard(&lines).ok_or_else(|| {
                    anyhow::anyhow!("--encrypt: vnetd at {} has no WireGuard key (start it with --wireguard-key-file)", socket.display())
                })
            }
            Err(e) => {
                tracing::warn!("vnetd at {}: {e:#}; waiting for it", socket.display());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

async fn run(args: Args) -> Result<()> {
    model::check_host_name(&args.host)?;
    let mut vnetd = vnetd::Vnetd::new(&args.socket);
    let wireguard = if args.encrypt { Some(wireguard_of(&mut vnetd, &args.socket).await?) } else { None };
    let me = store::Registration { host: args.host.clone(), underlay: args.underlay, port: args.port, wireguard, ttl: args.ttl };
    let mut store = store::Store::new(&args.etcd, me);
    store.handover = Duration::from_millis(args.handover_ms);
    let mut tick = tokio::time::interval(Duration::from_millis(args.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let changed = std::sync::Arc::new(tokio::sync::Notify::new());
    vnetd::watch(&args.socket, changed.clone());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut traffic_at = Instant::now();
    // vnetd's tables as last read (or as the agent's own last request left
    // them), and when the agent last derived and compared: a pass reads
    // them again only when vnetd's change count moved (someone else's
    // change: a user, a CNI plugin, a VM's rings), and every RESYNC.
    let mut cache: Option<vnetd::Cache> = None;
    let mut last_full = Instant::now();
    let mut last_pass = Instant::now() - PASS_GAP;
    let mut pass_took = Duration::ZERO;
    let mut last_macs: Option<String> = None;
    let mut last_conflicts: Vec<(std::net::IpAddr, String)> = Vec::new();
    // What the last pass put in force, network by network: a pass derives
    // again only the networks that changed (passes.rs).
    let mut deriver = passes::Deriver::default();
    // The hosts this one links to (`hosts_for`), made again only when a
    // registration changed: at 1,000 hosts a copy of them all per pass
    // cost more than the pass.
    let mut linked: (u64, BTreeMap<String, model::Host>) = (u64::MAX, BTreeMap::new());
    tracing::info!("vnet-agent for host {} ({}:{}), etcd {}", args.host, args.underlay, args.port, args.etcd.endpoints.join(","));
    let attention = store.attention.clone();
    loop {
        let due = store.due();
        let mut keep_alive = false;
        let event = tokio::select! {
            _ = tick.tick() => false,
            // vnetd changed (an interface, a VM's rings started or
            // stopped, a request committed by anyone): its count moved,
            // so this pass reads it.
            _ = changed.notified() => false,
            _ = store.next_event() => true,
            // The lease's task has news: it expired, or cannot be kept
            // alive through this connection.
            _ = attention.notified() => {
                keep_alive = true;
                false
            }
            // The lease's keep-alive (or another try at etcd): that alone,
            // unless it listed the overlay again.
            _ = tokio::time::sleep_until(due.into()) => {
                keep_alive = true;
                false
            }
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        };
        if keep_alive {
            store.maintain().await;
            if !store.wants_pass() {
                continue;
            }
        }
        // Events in a burst (a thousand hosts coming up) are taken a pass
        // at a time, PASS_GAP apart, or four times as long as the last
        // pass took (a machine short of CPU makes fewer, larger passes);
        // a lone change is taken at once.
        if event {
            let gap = PASS_GAP.max(pass_took * 4).min(Duration::from_secs(5));
            let since = last_pass.elapsed();
            if since < gap {
                tokio::time::sleep(gap - since).await;
            }
        }
        // Drain every event that is already there before deciding.
        store.drain().await;
        // The overlay's MAC list follows every guest, in any network.
        if let (Some(f), true) = (&args.macs_file, store.take_moved()) {
            if let Some(view) = store.view() {
                write_macs(f, view.guests, &mut last_macs);
            }
        }
        if event && !store.is_dirty() {
            // Nothing this host routes by: another network's guests, other
            // hosts' traffic counters.
            continue;
        }
        if args.encrypt {
            // vnetd's key may have changed (`WIREGUARD ROTATE`): the new
            // public key is published at once, for the peers to take.
            match vnetd.request("SHOW").map(|l| vnetd::parse_wireguard(&l)) {
                Ok(Some(wg)) => store.set_wireguard(wg),
                Ok(None) => tracing::warn!("vnetd has no WireGuard key any more: links stay as they are"),
                Err(e) => tracing::warn!("vnetd at {}: {e:#}", args.socket.display()),
            }
        }
        store.maintain().await;
        if last_full.elapsed() >= RESYNC {
            cache = None;
        }
        // One short request (vnetd's change count) when nothing changed
        // there; the tables read again when something did.
        let (state, read) = match vnetd.tables(&mut cache) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("vnetd at {}: {e:#}", args.socket.display());
                continue;
            }
        };
        store.publish(&state.ifaces, &state.ips).await;
        let traffic_due = args.traffic_s > 0 && traffic_at.elapsed() >= Duration::from_secs(args.traffic_s);
        if !store.take_dirty() && !traffic_due && !read {
            continue;
        }
        last_full = Instant::now();
        if traffic_due {
            traffic_at = Instant::now();
            match vnetd.request("STATS routes") {
                Ok(lines) => store.publish_traffic(show::traffic_of(state, &lines)).await,
                Err(e) => tracing::warn!("vnetd: cannot read route counters: {e:#}"),
            }
        }
        let moved = store.take_moved();
        let dirty = store.take_dirty_networks();
        if linked.0 != store.hosts_changed {
            linked = (store.hosts_changed, BTreeMap::new());
            if let Some(view) = store.view() {
                linked.1 = model::hosts_for(view.hosts, args.encrypt);
            }
        }
        let Some(view) = store.view() else { continue };
        if let (Some(f), true) = (&args.macs_file, moved) {
            write_macs(f, view.guests, &mut last_macs);
        }
        last_pass = Instant::now();
        let held = store.held(&state.ifaces);
        let pending = deriver.plan(&args.host, &linked.1, &view, &held, dirty.as_ref(), state, read);
        let revision = view.revision;
        if pending.lines.is_empty() {
            deriver.commit(pending, state);
        } else {
            let (n, incremental) = (pending.lines.len(), pending.incremental);
            match vnetd.apply(&pending.lines) {
                Ok(_) => {
                    // vnetd's count one past the cache's, on the same
                    // session: only this request changed it, and the cache
                    // is what it left. Otherwise read again at the next pass.
                    let mine = matches!((vnetd.count(), &cache), (Ok((s, c)), Some(k)) if k.session == s && k.count + 1 == c);
                    let c = cache.as_mut().expect("read above");
                    deriver.commit(pending, &mut c.state);
                    tracing::info!(
                        "applied {n} change(s) at etcd revision {revision} ({}): {} routes, {} links of ours",
                        if incremental { "the networks that changed" } else { "everything compared" },
                        c.state.routes.len(),
                        c.state.links.len()
                    );
                    if mine {
                        c.count += 1;
                    } else {
                        cache = None;
                    }
                }
                Err(e) => {
                    tracing::warn!("vnetd refused the agent's changes: {e:#}");
                    deriver.invalidate();
                    cache = None;
                }
            }
        }
        let conflicts = deriver.conflicts();
        if conflicts != last_conflicts {
            for (ip, mac) in conflicts.iter().filter(|c| !last_conflicts.contains(c)) {
                tracing::warn!("address {ip}: guest {mac} says it holds it, but another guest claimed it first: not bound to {mac}");
            }
            last_conflicts = conflicts;
        }
        pass_took = last_pass.elapsed();
    }
    // The lease is left to expire rather than revoked: an agent restarted
    // within its TTL takes its keys back and no other host notices.
    tracing::info!("vnet-agent stopped; vnetd keeps its routes (other hosts keep ours for {} s)", args.ttl);
    Ok(())
}
