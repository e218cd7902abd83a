//! vnetd's start and stop: the command line (`Args`), binding every socket
//! before anything runs, loading the kernel fast path, starting the
//! dispatchers, VTOE, the control servers and metrics, applying the config,
//! and tearing it all down on SIGTERM. The binary (`main.rs`) only parses
//! the command line and sets up logging.

use crate::control::access::{Role, Tokens, UnixPolicy};
use crate::control::{server, Control};
use crate::dispatch::{self, Datapath};
use crate::settings::{self, Settings};
use crate::{fast, metrics, stats, vtoe};
use anyhow::{bail, Context, Result};
use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR2};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(version, about = "VNET overlay daemon: one per host")]
pub struct Args {
    /// Control-language file applied (all or nothing) at start.
    #[arg(short, long)]
    pub config: Option<PathBuf>,
    /// Address the UDP link socket binds to (default: 0.0.0.0 and ::, each
    /// family if the host has it).
    #[arg(long)]
    pub udp_bind: Option<IpAddr>,
    /// Port for UDP and TCP links (ours, and the default remote port of a link).
    #[arg(long, default_value_t = 9000)]
    pub udp_port: u16,
    /// vnetd's WireGuard key pair, for `wireguard` links: a file as
    /// `wg genkey` writes it (base64), mode 600, owned by vnetd's user;
    /// made with a new key if missing. Without it vnetd has no WireGuard.
    #[arg(long, value_name = "FILE")]
    pub wireguard_key_file: Option<PathBuf>,
    /// Local UDP port of WireGuard links (bound at start when a key file
    /// is given; on --udp-bind's address if set).
    #[arg(long, default_value_t = vnet_core::command::WIREGUARD_PORT)]
    pub wireguard_port: u16,
    /// Local UDP port of VXLAN links (bound when the first one is added).
    #[arg(long, default_value_t = vnet_core::command::VXLAN_PORT)]
    pub vxlan_port: u16,
    /// Control over TCP on this ADDR:PORT (off by default). Every TCP
    /// session must begin with `AUTH <token>`, on loopback too: give
    /// --control-token-file and/or --control-read-token-file.
    #[arg(long, default_value = "none", value_name = "ADDR:PORT")]
    pub control_tcp: String,
    /// A file (mode 600) holding the token that TCP sessions give to change
    /// vnetd (`AUTH <token>`; at least 16 characters).
    #[arg(long, value_name = "FILE")]
    pub control_token_file: Option<PathBuf>,
    /// A file (mode 600) holding the token that TCP sessions give to read
    /// vnetd's state only (SHOW, STATS, LIST), e.g. for monitoring.
    #[arg(long, value_name = "FILE")]
    pub control_read_token_file: Option<PathBuf>,
    /// Control Unix socket path, or "none". Only root (and vnetd's own user)
    /// may use it, unless --control-group names a group.
    #[arg(long, default_value = "/run/vnetd.sock")]
    pub control_unix: String,
    /// A group (name or gid) whose members may use the Unix socket too (it
    /// is then mode 0660, that group's), with --control-group-role.
    #[arg(long, value_name = "GROUP")]
    pub control_group: Option<String>,
    /// What --control-group's members may do: read (SHOW, STATS, LIST,
    /// HELP) or admin (everything).
    #[arg(long, default_value = "read", value_name = "read|admin")]
    pub control_group_role: String,
    /// A host device that `LINK ADD direct <device>` may use (repeat, or
    /// comma-separate). No other device can be bridged onto the overlay.
    #[arg(long = "allow-direct", value_name = "DEVICE", value_delimiter = ',')]
    pub allow_direct: Vec<String>,
    /// Where TCP links' key files are: `LINK ADD <ip> tcp key <name>` reads
    /// <dir>/<name> (mode 600, owned by vnetd's user, 16 bytes at least;
    /// both ends of a link hold the same key).
    #[arg(long, default_value = "/etc/vnet/link-keys", value_name = "DIR")]
    pub link_key_dir: PathBuf,
    /// Where vhost-user sockets live: `INTERFACE ADD .. vhost-user <name>`
    /// serves (or, with `client`, connects to) <dir>/<name>, and nothing
    /// outside it. Made 0755 if missing; refused if others may write it.
    #[arg(long, default_value = "/run/vnet", value_name = "DIR")]
    pub vhost_user_dir: PathBuf,
    /// Where the kernel fast path is pinned (a folder on a bpf filesystem;
    /// vnetd mounts one at /sys/fs/bpf if nobody has), so that it outlives
    /// vnetd: frames it decided keep flowing while vnetd restarts or is
    /// upgraded, and the next vnetd adopts it. One folder per vnetd. "none":
    /// not pinned; the fast path stops when vnetd does.
    #[arg(long, default_value = "/sys/fs/bpf/vnet", value_name = "DIR|none")]
    pub pin_dir: String,
    /// Where vnetd records what it is told at run time (interfaces, links,
    /// routes and settings from vnetctl, vnet-agent, the CNI plugin), on
    /// each committed request; a vnetd started again restores it before it
    /// touches the kernel datapath, so a restart keeps every guest's
    /// flows. On a tmpfs by default: a reboot starts afresh. One file per
    /// vnetd (the unit's RuntimeDirectory, /run/vnet, kept across
    /// restarts). "none": nothing recorded; only the config is restored.
    #[arg(long, default_value = "/run/vnet/vnetd.state", value_name = "FILE|none")]
    pub state: String,
    /// Take over from the vnetd running with the same --state (an
    /// upgrade): it hands over its TAPs' descriptors and link sockets and
    /// exits, and this one starts with them, so no guest loses a frame the
    /// kernel could queue. A vnetd that will not hand over is stopped
    /// (SIGTERM) and this one starts as after a restart; with none
    /// running, it just starts.
    #[arg(long)]
    pub takeover: bool,
    /// Remove the kernel datapath pinned at --pin-dir (programs detached,
    /// maps freed, the devices vnetd made for it deleted) and exit. vnetd
    /// itself leaves it in place when it stops (SIGTERM), as OVS's kernel
    /// datapath stays when ovs-vswitchd stops.
    #[arg(long)]
    pub cleanup: bool,
    /// Do not load the kernel fast path: every frame takes the user-level
    /// datapath, and vnetd holds no eBPF maps (about 20 MB of kernel
    /// memory less: for hosts of TAP and vhost-user guests only, which the
    /// fast path does not carry, or many vnetds on one machine, as
    /// bench/scale.py runs them).
    #[arg(long)]
    pub no_fast_path: bool,
    /// MTU of interfaces added without one.
    #[arg(long, default_value_t = 1500)]
    pub default_mtu: u32,
    /// Dispatcher threads (interfaces and links are spread over them; each
    /// reads its own UDP socket, peers spread over them by the kernel).
    #[arg(long, default_value_t = 1)]
    pub dispatchers: usize,
    /// Pin dispatcher thread i to the i-th CPU of this list, e.g. 1 or 2,3.
    #[arg(long, value_delimiter = ',')]
    pub cpus: Vec<usize>,
    /// How dispatcher threads compete with busy applications for a CPU
    /// (docs/datapath.md: the slow path under contention).
    #[arg(long, value_enum, default_value = "realtime")]
    pub dispatcher_sched: settings::Sched,
    /// Offer VTOE (virtual TCP offload, docs/vtoe.md): `vtoe` runners in
    /// guest namespaces reach vnetd on this Unix socket. Off when not given.
    #[arg(long, value_name = "PATH")]
    pub vtoe_socket: Option<PathBuf>,
    /// TCP port of VTOE's shadow connections between hosts (the same on
    /// every host; bound on --udp-bind's address if given).
    #[arg(long, default_value_t = 9002)]
    pub vtoe_port: u16,
    /// Log level: error, warn, info, debug or trace (RUST_LOG overrides).
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Log as text for people, or as one JSON object per line for log
    /// pipelines (journald, Loki, Elasticsearch).
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Serve Prometheus/OpenMetrics metrics at http://ADDR:PORT/metrics (a
    /// bare PORT is on loopback). Off when not given. Anyone who can reach
    /// it reads the counters: keep it on loopback or a management network.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics: Option<String>,
    /// Print a completion script for this shell and exit.
    #[arg(long, value_name = "SHELL")]
    pub completions: Option<clap_complete::Shell>,
    /// Print vnetd's manual page (roff) and exit.
    #[arg(long)]
    pub man: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// `--metrics`: ADDR:PORT, or a bare PORT on loopback.
fn metrics_addr(s: &str) -> Result<SocketAddr> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port));
    }
    s.parse::<SocketAddr>().with_context(|| format!("--metrics '{s}' is not ADDR:PORT or PORT"))
}


/// Runs vnetd until SIGINT or SIGTERM (or, with --cleanup, removes the
/// pinned kernel datapath).
pub fn run(args: Args) -> Result<()> {
    let pin_dir = (args.pin_dir != "none").then(|| PathBuf::from(&args.pin_dir));
    if args.cleanup {
        let Some(dir) = &pin_dir else { bail!("--cleanup needs a --pin-dir") };
        // What it would restore goes with it.
        if args.state != "none" {
            match std::fs::remove_file(&args.state) {
                Ok(()) => tracing::info!("removed the state file {}", args.state),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => bail!("cannot remove the state file {}: {e}", args.state),
            }
        }
        if !dir.exists() {
            tracing::info!("nothing pinned at {}", dir.display());
            return Ok(());
        }
        return fast::destroy(dir);
    }
    let fds = vnet_sys::process::raise_fd_limit();
    tracing::debug!(fds, "descriptor limit");
    if !(vnet_core::command::MIN_MTU..=vnet_core::command::MAX_MTU).contains(&args.default_mtu) {
        bail!("--default-mtu {} is out of range", args.default_mtu);
    }
    let control_tcp = match args.control_tcp.as_str() {
        "none" => None,
        s => Some(s.parse::<SocketAddr>().with_context(|| format!("--control-tcp '{s}' is not ADDR:PORT"))?),
    };
    let admin_token = args.control_token_file.as_deref().map(server::read_token).transpose()?;
    let read_token = args.control_read_token_file.as_deref().map(server::read_token).transpose()?;
    let tokens = match (control_tcp, admin_token.is_some() || read_token.is_some()) {
        (Some(a), false) => bail!(
            "--control-tcp {a} needs --control-token-file and/or --control-read-token-file: \
             every TCP control session must authenticate, on loopback too"
        ),
        (None, true) => bail!("--control-token-file and --control-read-token-file are for --control-tcp, which is not given"),
        (None, false) => None,
        (Some(_), true) => Some(Tokens::new(admin_token, read_token).map_err(|e| anyhow::anyhow!("control tokens: {e}"))?),
    };
    let control_unix = (args.control_unix != "none").then(|| PathBuf::from(&args.control_unix));
    let group_role = Role::parse(&args.control_group_role).map_err(|e| anyhow::anyhow!("--control-group-role: {e}"))?;
    let control_group = args.control_group.as_deref().map(lookup_group).transpose()?;
    let unix_policy = UnixPolicy {
        daemon_uid: nix::unistd::geteuid().as_raw(),
        group: control_group.map(|gid| (gid, group_role)),
    };
    let config = match &args.config {
        Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("cannot read config {}", p.display()))?),
        None => None,
    };

    // Descriptors the previous vnetd kept for this one: from systemd's
    // store, or handed over by the running one (--takeover), which has
    // exited when this returns.
    let from_systemd = crate::sys::keep::from_systemd();
    if from_systemd > 0 {
        tracing::info!("{from_systemd} descriptor(s) from systemd's store");
    }
    if args.takeover {
        if args.state == "none" {
            bail!("--takeover finds the running vnetd by its --state file: give it");
        }
        crate::handover::take_over(&crate::handover::path(std::path::Path::new(&args.state)), std::time::Duration::from_secs(30))?;
    }
    // The state file, locked for this vnetd, and what it holds: read
    // before anything is loaded, restored once the datapath runs.
    let (journal, records) = match args.state.as_str() {
        "none" => (None, Vec::new()),
        p => {
            let (j, r) = crate::control::journal::Journal::open(std::path::Path::new(p))?;
            (Some(j), r)
        }
    };
    if !(1..=64).contains(&args.dispatchers) {
        bail!("--dispatchers {} is out of range 1..64", args.dispatchers);
    }
    if let Some(c) = args.cpus.iter().find(|&&c| c >= libc::CPU_SETSIZE as usize) {
        bail!("--cpus {c} is beyond the kernel's CPU set ({})", libc::CPU_SETSIZE);
    }
    let metrics = args.metrics.as_deref().map(metrics_addr).transpose()?.map(metrics::bind).transpose()?;
    let tcp_listener = control_tcp.map(server::bind_tcp).transpose()?;
    let unix_listener = control_unix.as_deref().map(|p| server::bind_unix(p, control_group)).transpose()?;

    for dev in &args.allow_direct {
        vnet_core::command::check_ifname(dev).map_err(|e| anyhow::anyhow!("--allow-direct: {e}"))?;
    }
    // The vhost-user directory, made now (0755) if missing, so that a VMM
    // can be pointed at it before the first NIC; a failure only means the
    // first vhost-user NIC will say why.
    if !args.vhost_user_dir.exists() {
        match std::fs::create_dir_all(&args.vhost_user_dir) {
            Ok(()) => {
                let _ = std::fs::set_permissions(&args.vhost_user_dir, std::os::unix::fs::PermissionsExt::from_mode(0o755));
            }
            Err(e) => tracing::info!("cannot make {} yet: {e}", args.vhost_user_dir.display()),
        }
    }
    let settings = Settings {
        default_link_port: args.udp_port,
        default_mtu: args.default_mtu,
        direct_devices: args.allow_direct.clone(),
        link_key_dir: args.link_key_dir.clone(),
        vhost_user_dir: args.vhost_user_dir.clone(),
        changes: Default::default(),
        udp_bind: args.udp_bind,
        vxlan_port: args.vxlan_port,
        wireguard_key_file: args.wireguard_key_file.clone(),
        wireguard_port: args.wireguard_port,
    };
    let mut dp = Datapath::new(args.udp_bind, args.dispatchers, &args.cpus)?;
    dp.sched = args.dispatcher_sched;
    // Link sockets are read once the links are in force (`Control::start`).
    dp.close_links();
    let mut adopted_flows = 0;
    let opened = if args.no_fast_path {
        Err(anyhow::anyhow!("--no-fast-path"))
    } else {
        vnet_fastpath::Kernel::open(pin_dir.as_deref(), args.udp_port)
    };
    dp.fast = match opened {
        // Two vnetds on one datapath: refused, not run without a fast path.
        Err(e) if e.downcast_ref::<vnet_fastpath::pin::InUse>().is_some() => return Err(e),
        Ok((k, opened)) => match fast::FastPath::new(k) {
            Ok(f) => {
                if let vnet_fastpath::Opened::Adopted { flows, .. } = opened {
                    adopted_flows = flows;
                }
                let how = match (opened, &pin_dir) {
                    (_, None) => "not pinned: it stops when vnetd does".to_string(),
                    (vnet_fastpath::Opened::Fresh, Some(d)) => format!("pinned at {}", d.display()),
                    (vnet_fastpath::Opened::Adopted { flows, ports, links, attachments }, Some(d)) => format!(
                        "adopted from {}: {flows} flow entries, {ports} ports, {links} links, {attachments} attachments",
                        d.display()
                    ),
                    (vnet_fastpath::Opened::Replaced { layout }, Some(d)) => format!(
                        "pinned at {}, new maps in place of layout {layout}'s (this build's is {}): flows and counters start anew",
                        d.display(),
                        vnet_fastpath::LAYOUT
                    ),
                };
                tracing::info!("kernel fast path loaded (eBPF, TCX), {how}; SET datapath user turns it off");
                Some(Arc::new(f))
            }
            Err(e) => {
                tracing::warn!("kernel fast path unavailable ({e:#}); every frame takes the user-level datapath");
                None
            }
        },
        Err(_) if args.no_fast_path => {
            tracing::info!("kernel fast path not loaded (--no-fast-path); every frame takes the user-level datapath");
            None
        }
        Err(e) => {
            tracing::warn!("kernel fast path unavailable ({e:#}); every frame takes the user-level datapath");
            None
        }
    };
    let dp = Datapath::shared(dp);
    // Each link kind binds what it binds from the start (VNET/P's UDP port:
    // a busy port is said here; WireGuard's with a key), one socket per
    // dispatcher and family on the same port.
    for k in crate::link::kinds::ALL {
        if let Err(e) = k.start(&settings, &*dp) {
            if let Some(f) = &dp.fast {
                f.shutdown();
            }
            bail!("{e}");
        }
    }
    // Without a dispatcher nothing is forwarded: a failed one stops the daemon.
    let dispatchers = dispatch::spawn(&dp, || {
        let _ = signal_hook::low_level::raise(SIGTERM);
    })?;
    // After the datapath's sockets exist: VTOE puts vnetd in a cgroup of
    // its own, whose eBPF guard watches the sockets made from then on.
    let vtoe = match &args.vtoe_socket {
        Some(path) => {
            let cfg = vtoe::Config { socket: path.clone(), port: args.vtoe_port, bind: args.udp_bind };
            match vtoe::Vtoe::start(dp.clone(), cfg) {
                Ok(v) => Some(v),
                Err(e) => {
                    dp.shutdown();
                    if let Some(f) = &dp.fast {
                        f.shutdown();
                    }
                    return Err(e.context("VTOE"));
                }
            }
        }
        None => None,
    };
    let ctl = Arc::new(Control::new(dp.clone(), settings, vtoe.clone(), journal));

    let cleanup = |dp: &Datapath| {
        dp.shutdown();
        if let Some(f) = &dp.fast {
            f.shutdown();
        }
        if let Some(v) = &vtoe {
            v.shutdown();
        }
        if let Some(p) = &control_unix {
            let _ = std::fs::remove_file(p);
        }
    };
    // What the state file recorded, then the config: in force before
    // anything is swept from the kernel datapath.
    let t0 = std::time::Instant::now();
    let given = args.config.as_deref().zip(config.as_deref());
    match ctl.start(records, given) {
        Ok(r) => tracing::info!("in force in {:.3} s ({} change(s) restored from the state file)", t0.elapsed().as_secs_f64(), r.changes),
        Err(e) => {
            cleanup(&dp);
            match &args.config {
                Some(p) => bail!("config {}: {e}", p.display()),
                None => bail!("{e}"),
            }
        }
    }
    // The config is in force: what the fast path held that it no longer
    // says goes, before vnetd tells anyone it is ready.
    if let Some(f) = &dp.fast {
        f.finish_start(&dp.snapshot(), adopted_flows);
    }
    let unused = crate::sys::keep::rest();
    if !unused.is_empty() {
        tracing::info!("{} kept descriptor(s) nothing here took, closed: {}", unused.len(), unused.join(", "));
    }
    if let (Some(l), Some(tokens)) = (tcp_listener, tokens) {
        server::spawn_tcp(ctl.clone(), l, tokens);
    }
    if let (Some(l), Some(p)) = (unix_listener, &control_unix) {
        server::spawn_unix(ctl.clone(), l, p.clone(), unix_policy);
    }
    if let Some(server) = metrics {
        if let Err(e) = metrics::spawn(ctl.clone(), server) {
            cleanup(&dp);
            return Err(e);
        }
    }
    tracing::info!(
        "vnetd ready: links on {}, control tcp {}, unix {}{}",
        dp.udp_addrs(),
        control_tcp.map_or("none".into(), |a| a.to_string()),
        control_unix.as_ref().map_or("none".into(), |p| p.display().to_string()),
        control_group.map_or(String::new(), |g| format!(" (group {g}: {})", group_role.name()))
    );
    // Under systemd (Type=notify): ready once the sockets listen and the
    // config is in force. Elsewhere NOTIFY_SOCKET is unset and this does nothing.
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!("cannot tell systemd vnetd is ready: {e}");
    }

    // A successor may take over (--takeover): it finds this vnetd by its
    // state file.
    if args.state != "none" {
        let path = crate::handover::path(std::path::Path::new(&args.state));
        if let Err(e) = crate::handover::listen(&path, || {
            let _ = signal_hook::low_level::raise(SIGTERM);
        }) {
            tracing::warn!("no hand-over at upgrades: {e:#}");
        }
    }
    // A vnetd that took over under systemd is the unit's main process
    // from now on (the unit's NotifyAccess=all lets it say so).
    if args.takeover {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::MainPid(std::process::id())]);
    }
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR2])?;
    for sig in signals.forever() {
        if sig == SIGUSR2 {
            // An upgrade in place: the binary at vnetd's own path (the new
            // build, once installed) started with --takeover; this vnetd
            // hands over to it, or goes on if it fails to start.
            successor(&args.state);
            continue;
        }
        tracing::info!("signal {sig}: shutting down");
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        break;
    }
    cleanup(&dp);
    let joined: Vec<_> = dispatchers.into_iter().map(|h| h.join()).collect();
    // Nothing reads the TAPs and sockets any more: a successor taking
    // over gets them now, and sees the connection close when this process
    // has exited (its locks free).
    if let Some(conn) = crate::handover::serve() {
        std::mem::forget(conn);
    }
    ctl.shutdown();
    for j in joined {
        match j {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("dispatcher failed: {e:#}"),
            Err(_) => bail!("dispatcher panicked"),
        }
    }
    tracing::info!(
        "stopped; drops: no_route={} unknown_sender={}",
        ctl.total_drops(stats::DropReason::NoRoute),
        ctl.total_drops(stats::DropReason::UnknownSender)
    );
    Ok(())
}

/// SIGUSR2: starts the binary at this vnetd's path with this vnetd's
/// arguments and `--takeover` (nginx's binary upgrade, and systemd's: the
/// new process is in the unit's cgroup and tells systemd it is the main
/// one). Its exit is reaped and logged should it fail before taking over.
fn successor(state: &str) {
    if state == "none" {
        tracing::warn!("SIGUSR2: no hand-over without --state; restart vnetd instead");
        return;
    }
    let mut argv = std::env::args_os();
    let Some(exe) = argv.next() else { return };
    let args: Vec<std::ffi::OsString> = argv.filter(|a| a != "--takeover").collect();
    let child = std::process::Command::new(&exe)
        .args(&args)
        .arg("--takeover")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_FDNAMES")
        .env_remove("LISTEN_PID")
        .stdin(std::process::Stdio::null())
        .spawn();
    match child {
        Ok(mut c) => {
            tracing::info!("SIGUSR2: started {} (pid {}) to take over", exe.to_string_lossy(), c.id());
            let _ = std::thread::Builder::new().name("successor".into()).spawn(move || {
                if let Ok(status) = c.wait() {
                    tracing::warn!("the new vnetd exited ({status}) before taking over; this one goes on");
                }
            });
        }
        Err(e) => tracing::warn!("SIGUSR2: cannot start {}: {e}; this vnetd goes on", exe.to_string_lossy()),
    }
}

/// A group given by name or number, as its gid.
fn lookup_group(g: &str) -> Result<u32> {
    if let Ok(gid) = g.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(g) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        Ok(None) => bail!("--control-group: no group named {g}"),
        Err(e) => bail!("--control-group: cannot look up {g}: {e}"),
    }
}
