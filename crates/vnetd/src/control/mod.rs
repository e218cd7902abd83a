//! The control plane: executes control-language requests against the
//! topology, all or nothing, and renders state and counters as text.
//!
//! Output lines are `kind key=value ...`, readable by people and by scripts.

pub mod access;
pub mod server;

use crate::dispatch::Datapath;
use crate::stats::Drop;
use crate::topology::{LinkKind, Settings, Topology};
use std::sync::atomic::Ordering::Relaxed;
use access::{Caller, Role};
use std::sync::{Arc, Mutex};
use vnet_core::command::{parse_request, Attach, Command, Mode, StatsScope, HELP};

pub struct Control {
    topo: Mutex<(Topology, u64)>,
    dp: Arc<Datapath>,
    settings: Settings,
}

impl Control {
    pub fn new(dp: Arc<Datapath>, settings: Settings) -> Control {
        Control { topo: Mutex::new((Topology::default(), 0)), dp, settings }
    }

    /// Executes a request (one or more lines) for `caller`. On success
    /// returns the output lines; on failure returns `line N: reason: text`
    /// and nothing changed. A request with any change in it needs the admin
    /// role, and every applied change is logged with who made it.
    pub fn execute(&self, request: &str, caller: &Caller) -> Result<Vec<String>, String> {
        let cmds = parse_request(request).map_err(|e| e.to_string())?;
        let line_text = |line: usize| request.lines().nth(line - 1).unwrap_or("").trim();
        if caller.role != Role::Admin {
            if let Some((line, _)) = cmds.iter().find(|(_, c)| c.mutates()) {
                tracing::warn!("control: {caller}: refused a change: {}", line_text(*line));
                return Err(format!(
                    "line {line}: permission denied: {caller} may only read (SHOW, STATS, LIST, HELP): {}",
                    line_text(*line)
                ));
            }
        }
        let mut guard = self.topo.lock().unwrap_or_else(|p| p.into_inner());
        let (current, generation) = &mut *guard;
        let mut work = current.clone();
        let mut out = Vec::new();
        let mut changed = false;
        for (line, cmd) in &cmds {
            if cmd.mutates() {
                let msg = work
                    .apply(cmd, &self.settings, &self.dp)
                    .map_err(|reason| format!("line {line}: {reason}: {}", line_text(*line)))?;
                out.push(msg);
                changed = true;
            } else {
                self.report(cmd, &work, &mut out);
            }
        }
        if changed {
            *generation += 1;
            // Publishing commits the request (the snapshot settles which
            // persistent TAPs stay); deleted interfaces go once unused.
            self.dp.publish(work.snapshot(*generation));
            work.deleted.clear();
            // New TCP links start connecting once they are in force.
            for l in work.links.values() {
                if let LinkKind::Tcp(t) = &l.kind {
                    t.start(self.dp.clone(), Arc::downgrade(l));
                }
            }
            *current = work;
            log_changes(caller, &cmds, line_text);
        }
        Ok(out)
    }

    fn report(&self, cmd: &Command, t: &Topology, out: &mut Vec<String>) {
        match cmd {
            Command::IfaceList => list_ifaces(t, out),
            Command::LinkList => list_links(t, out),
            Command::RouteList => list_routes(t, out),
            Command::Stats(scope) => self.stats(*scope, t, out),
            Command::Show => {
                let udp = self.dp.udp_addrs();
                out.push(format!(
                    "vnetd version={} sockets={udp} default_mtu={} default_link_port={} dispatchers={}",
                    env!("CARGO_PKG_VERSION"),
                    self.settings.default_mtu,
                    self.settings.default_link_port,
                    self.dp.worker_count()
                ));
                out.push(format!("settings {}", t.dispatch.render()));
                list_ifaces(t, out);
                list_links(t, out);
                list_routes(t, out);
            }
            Command::Help => out.extend(HELP.lines().map(String::from)),
            _ => {}
        }
    }

    fn stats(&self, scope: StatsScope, t: &Topology, out: &mut Vec<String>) {
        let all = scope == StatsScope::All;
        if all || scope == StatsScope::Global {
            out.push(format!("global {}", self.dp.global.render()));
            out.push(format!("offload {}", self.dp.offload.render()));
            out.push(format!("dispatch {}", self.dp.dispatch.render()));
        }
        if all || scope == StatsScope::Interfaces {
            for i in t.ifaces.values() {
                let configured = t.iface_settings.get(&i.idx).copied().unwrap_or_default().effective(&t.dispatch).mode;
                let running = if i.running_mode.load(Relaxed) == Mode::VmmDriven as u8 { Mode::VmmDriven } else { Mode::GuestDriven };
                out.push(format!(
                    "interface {} name={} mode={} running={} mode_switches={} {}",
                    i.idx,
                    i.name,
                    configured.name(),
                    running.name(),
                    i.mode_switches.load(Relaxed),
                    i.stats.render()
                ));
            }
        }
        if all || scope == StatsScope::Links {
            for l in t.links.values() {
                out.push(format!("link {} name={} {}", l.idx, l.name, l.stats.render()));
            }
        }
        if all || scope == StatsScope::Routes {
            for r in t.routes.values() {
                out.push(format!(
                    "route {} frames={} bytes={} rule={}",
                    r.idx,
                    r.stats.out_frames.load(Relaxed),
                    r.stats.out_bytes.load(Relaxed),
                    r.spec
                ));
            }
        }
    }

    /// Removes every interface (and so every TAP vnetd made, QEMU's too);
    /// called once the dispatcher has stopped.
    pub fn shutdown(&self) {
        let mut guard = self.topo.lock().unwrap_or_else(|p| p.into_inner());
        guard.0 = Topology::default();
        self.dp.clear();
    }

    /// Drops of one reason over the whole daemon (for the log at exit).
    pub fn total_drops(&self, why: Drop) -> u64 {
        self.dp.global.drops(why)
    }
}

/// Logs the changes a request applied, and who made them (the first few
/// lines in full, then a count).
fn log_changes<'a>(caller: &Caller, cmds: &[(usize, Command)], line_text: impl Fn(usize) -> &'a str) {
    const SHOWN: usize = 10;
    let changes: Vec<usize> = cmds.iter().filter(|(_, c)| c.mutates()).map(|(l, _)| *l).collect();
    let mut text = changes.iter().take(SHOWN).map(|l| line_text(*l)).collect::<Vec<_>>().join("; ");
    if changes.len() > SHOWN {
        text.push_str(&format!("; and {} more", changes.len() - SHOWN));
    }
    tracing::info!("control: {caller} applied {} change(s): {text}", changes.len());
}

fn list_ifaces(t: &Topology, out: &mut Vec<String>) {
    for i in t.ifaces.values() {
        let own = t.iface_settings.get(&i.idx).copied().unwrap_or_default().render();
        let attach = match i.attach {
            Attach::Netns => "netns",
            Attach::Qemu => "qemu",
        };
        let netns = i.netns.as_ref().map_or(String::new(), |n| format!(" netns={n}"));
        out.push(format!("interface {} name={} mac={} mtu={} attach={attach}{netns} {own}", i.idx, i.name, i.mac, i.mtu));
    }
}

fn list_links(t: &Topology, out: &mut Vec<String>) {
    for l in t.links.values() {
        let remote = l.remote.map_or(String::new(), |r| format!(" remote={r}"));
        let extra = match &l.kind {
            LinkKind::Vxlan { vni } => format!(" vni={vni}"),
            LinkKind::Tcp(t) => {
                let (state, since) = t.state();
                format!(" state={} since={:.1}s", state.name(), since.as_secs_f64())
            }
            LinkKind::Direct { device, .. } => format!(" device={device}"),
            LinkKind::Udp => String::new(),
        };
        out.push(format!(
            "link {} name={} proto={}{remote} mtu={} max_frame={}{extra}",
            l.idx,
            l.name,
            l.kind.name(),
            l.mtu,
            l.max_frame
        ));
    }
}

fn list_routes(t: &Topology, out: &mut Vec<String>) {
    for r in t.routes.values() {
        out.push(format!("route {} {}", r.idx, r.spec));
    }
}
