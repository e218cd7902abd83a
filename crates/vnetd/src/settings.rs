//! What vnetd runs by, apart from its topology: the daemon's settings from
//! the command line (`Settings`), the dispatcher's tunables (`SET`, with
//! the papers' defaults: `DispatchSettings`), an interface's own overrides
//! (`INTERFACE SET`), how NICs with shared rings interrupt their guests
//! (`IrqPolicy`), and how dispatcher threads are scheduled (`Sched`).
//!
//! Plain values, on the ground floor: the control plane sets them, the
//! datapath reads them, and this file imports neither.

use std::path::PathBuf;
use vnet_core::command::{Datapath, Interrupts, Mode, YieldStrategy};

/// Daemon-wide settings the control language consults.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Remote port of a link added without one (the daemon's own UDP port).
    pub default_link_port: u16,
    /// MTU of an interface added without one.
    pub default_mtu: u32,
    /// Host devices the administrator allowed direct links on
    /// (`--allow-direct`); no other device can be named by `LINK ADD direct`.
    pub direct_devices: Vec<String>,
    /// Where TCP links' key files are (`--link-key-dir`).
    pub link_key_dir: PathBuf,
    /// Where vhost-user sockets live (`--vhost-user-dir`).
    pub vhost_user_dir: PathBuf,
    /// What control clients wait on with `WAIT` (NICs report their guest
    /// starting or stopping there).
    pub changes: std::sync::Arc<crate::stats::Changes>,
    /// The one address link sockets bind (`--udp-bind`), if given.
    pub udp_bind: Option<std::net::IpAddr>,
    /// VXLAN's local UDP port (`--vxlan-port`).
    pub vxlan_port: u16,
    /// vnetd's WireGuard key file (`--wireguard-key-file`) and port
    /// (`--wireguard-port`): WireGuard links only with a key.
    pub wireguard_key_file: Option<PathBuf>,
    pub wireguard_port: u16,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            default_link_port: 9000,
            default_mtu: 1500,
            direct_devices: Vec::new(),
            link_key_dir: PathBuf::new(),
            vhost_user_dir: PathBuf::from("/run/vnet"),
            changes: Default::default(),
            udp_bind: None,
            vxlan_port: vnet_core::command::VXLAN_PORT,
            wireguard_key_file: None,
            wireguard_port: vnet_core::command::WIREGUARD_PORT,
        }
    }
}

/// The dispatcher's tunables (`SET ...`), with the papers' and the original
/// code's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DispatchSettings {
    pub mode: Mode,
    pub yield_strategy: YieldStrategy,
    pub sleep_us: u32,
    pub nowork_us: u32,
    pub alpha_lower: u32,
    pub alpha_upper: u32,
    pub window_ms: u32,
    pub quota: u32,
    pub datapath: Datapath,
    pub interrupts: Interrupts,
    /// Optimistic interrupts' α and β (receive density, kB/s).
    pub eoc_alpha: u32,
    pub eoc_beta: u32,
    /// Frames sent from guests' shared memory uncopied.
    pub cut_through: bool,
    /// Storm control: broadcast and multicast frames a guest may send a
    /// second, a burst of as many (0: no limit).
    pub storm_pps: u32,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        DispatchSettings {
            // Event-driven, woken at once (a real-time dispatcher, see
            // worker::Sched): measured better than adaptive for applications
            // that keep the CPUs busy (MPI), and no worse for bulk TCP.
            mode: Mode::GuestDriven,
            yield_strategy: YieldStrategy::Adaptive,
            sleep_us: 1000,
            nowork_us: 1000,
            alpha_lower: 1_000,
            alpha_upper: 10_000,
            window_ms: 5,
            quota: 64,
            datapath: Datapath::Auto,
            interrupts: Interrupts::Plain,
            // Below 1 MB/s a stream is cold; above 200 MB/s (1.6 Gbit/s)
            // early interrupts drive it (docs/vhost-user.md).
            eoc_alpha: 1_000,
            eoc_beta: 200_000,
            cut_through: true,
            // Far above what a guest's ARP, neighbour discovery and DHCP
            // send; a broadcast storm is cut to it (docs/controller.md).
            storm_pps: 1000,
        }
    }
}

impl DispatchSettings {
    pub fn render(&self) -> String {
        format!(
            "mode={} yield={} sleep-us={} nowork-us={} alpha-lower={} alpha-upper={} window-ms={} quota={} datapath={} interrupts={} eoc-alpha={} eoc-beta={} cut-through={} storm-pps={}",
            self.mode.name(),
            self.yield_strategy.name(),
            self.sleep_us,
            self.nowork_us,
            self.alpha_lower,
            self.alpha_upper,
            self.window_ms,
            self.quota,
            self.datapath.name(),
            self.interrupts.name(),
            self.eoc_alpha,
            self.eoc_beta,
            if self.cut_through { "on" } else { "off" },
            self.storm_pps
        )
    }
}

/// An interface's own dispatch settings (`INTERFACE SET`); `None` follows
/// the global one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IfaceOverrides {
    pub mode: Option<Mode>,
    pub alpha_lower: Option<u32>,
    pub alpha_upper: Option<u32>,
    pub window_ms: Option<u32>,
}

/// What an interface's dispatch runs by: its overrides over the globals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IfaceDispatch {
    pub mode: Mode,
    pub alpha_lower: u32,
    pub alpha_upper: u32,
    pub window_ms: u32,
}

impl IfaceOverrides {
    pub fn effective(&self, d: &DispatchSettings) -> IfaceDispatch {
        IfaceDispatch {
            mode: self.mode.unwrap_or(d.mode),
            alpha_lower: self.alpha_lower.unwrap_or(d.alpha_lower),
            alpha_upper: self.alpha_upper.unwrap_or(d.alpha_upper),
            window_ms: self.window_ms.unwrap_or(d.window_ms),
        }
    }

    /// `mode=.. alpha-lower=.. alpha-upper=.. window-ms=..`, "default" where
    /// the interface follows the global value.
    pub fn render(&self) -> String {
        let n = |v: Option<u32>| v.map_or("default".to_string(), |v| v.to_string());
        format!(
            "mode={} alpha-lower={} alpha-upper={} window-ms={}",
            self.mode.map_or("default", |m| m.name()),
            n(self.alpha_lower),
            n(self.alpha_upper),
            n(self.window_ms)
        )
    }
}

/// How NICs with shared rings interrupt their guests (`SET interrupts`,
/// `eoc-alpha`, `eoc-beta`): the vhost-user device's own type.
pub use vnet_vhost::IrqPolicy;

/// The interrupt policy the dispatcher's settings give.
pub fn irq_policy(d: &DispatchSettings) -> IrqPolicy {
    IrqPolicy {
        optimistic: d.interrupts == Interrupts::Optimistic,
        alpha: u64::from(d.eoc_alpha) * 1000,
        beta: u64::from(d.eoc_beta) * 1000,
    }
}

/// How dispatcher threads are scheduled against busy applications on the
/// same CPUs (`--dispatcher-sched`; measured in docs/datapath.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sched {
    /// A normal task throughout: a woken dispatcher may wait for a busy
    /// task's slice to end (milliseconds).
    Normal,
    /// Real-time (FIFO, priority 1) while the thread is event-driven (it
    /// sleeps until a frame, as an interrupt handler would): a woken
    /// dispatcher runs at once. A normal task while it polls (VMM-driven),
    /// so that polling never holds a CPU against applications.
    Realtime,
}
