//! The control plane: executes control-language requests against the
//! topology, all or nothing, and renders state and counters as text.
//!
//! Output lines are `kind key=value ...`, readable by people and by scripts.

pub mod access;
pub mod journal;
pub mod json;
pub mod server;

use crate::dispatch::Datapath;
use crate::stats::DropReason;
use crate::settings::Settings;
use crate::topology::{Retired, Topology};
use std::sync::atomic::Ordering::Relaxed;
use access::{Caller, Role};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::path::Path;
use vnet_core::command::{parse_line, parse_request, Command, Mode, StatsScope, HELP};

pub struct Control {
    state: Mutex<State>,
    dp: Arc<Datapath>,
    pub(crate) settings: Settings,
    /// VTOE, when vnetd offers it (--vtoe-socket).
    vtoe: Option<Arc<crate::vtoe::Vtoe>>,
}

/// The control plane's state, behind one lock.
#[derive(Default)]
struct State {
    topo: Topology,
    generation: u64,
    /// Objects taken out of the topology, with the generation that no longer
    /// has them: torn down once every dispatcher runs that generation.
    retiring: Vec<(u64, Retired)>,
    /// The config file (--config) and its changes (line number, text) as
    /// last applied, for `RELOAD`.
    config: Option<journal::Applied>,
    /// Where each committed request is recorded (--state), if anywhere.
    journal: Option<journal::Journal>,
}

/// What a start restored from the state file.
#[derive(Default, Debug)]
pub struct Restored {
    /// Changes restored, those skipped (each said in the log), and those
    /// left to the config (its own objects and settings).
    pub changes: usize,
    pub skipped: usize,
    pub config: usize,
}

impl Control {
    pub fn new(dp: Arc<Datapath>, settings: Settings, vtoe: Option<Arc<crate::vtoe::Vtoe>>, journal: Option<journal::Journal>) -> Control {
        let mut state = State { journal, ..State::default() };
        state.topo.kernel = dp.fast.as_ref().map(|f| f.kernel.clone());
        // Ids are recorded only where something outlives vnetd that names them.
        state.topo.ids = crate::topology::Ids::new(state.topo.kernel.clone().filter(|k| k.pin_dir().is_some()));
        Control { state: Mutex::new(state), dp, settings, vtoe }
    }

    /// vnetd's start, before anything is swept from the kernel datapath or
    /// anyone is answered: the config file (`config`: its path and text)
    /// applied whole, as always; then what the state file recorded
    /// (`records`) that is not the config's. The config is authoritative
    /// for the objects its lines made when vnetd last ran (and for the
    /// settings it gives now): their lines in the state are left to it, so
    /// a line edited or removed while vnetd was down takes effect as
    /// written. Everything else — what vnetctl, vnet-agent and the CNI
    /// plugin added at run time — is restored.
    pub fn start(&self, records: Vec<journal::Record>, config: Option<(&Path, &str)>) -> Result<Restored, String> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let commands = |lines: &mut dyn Iterator<Item = &str>| -> Vec<Command> { lines.filter_map(|l| parse_line(l).ok().flatten()).collect() };
        // What the config in force last time made.
        let last = records.iter().rev().find_map(|r| match r {
            journal::Record::Config((_, lines)) => Some(lines.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>()),
            _ => None,
        });
        let mut owned: HashSet<String> = commands(&mut last.unwrap_or_default().into_iter()).iter().flat_map(config_keys).collect();
        state.config = None;
        if let Some((path, text)) = config {
            let lines = self.execute_locked(state, text, &Caller::config(path))?;
            tracing::info!("config {}: {} changes applied", path.display(), lines.len());
            let now = config_changes(text);
            // The settings it gives now are its own.
            owned.extend(commands(&mut now.iter().map(|(_, l)| l.as_str())).iter().filter(|c| matches!(c, Command::Set(_))).flat_map(config_keys));
            state.config = Some((path.to_path_buf(), now));
        }
        let restored = if records.is_empty() { Restored::default() } else { self.restore(state, records, &owned) };
        // The links are in force: their sockets are read from now on (what
        // waited in one kept from the vnetd before is read now, by them).
        self.dp.open_links();
        state.generation += 1;
        self.dp.publish(state.topo.snapshot(state.generation));
        // A new snapshot: the file holds what is in force now, and nothing
        // that failed to restore.
        let script = state.topo.script();
        if let Some(j) = &mut state.journal {
            if let Err(e) = j.compact(state.config.as_ref(), &script) {
                tracing::error!("state file {}: cannot write it: {e:#}", j.path().display());
            }
        }
        Ok(restored)
    }

    /// Restores the state file's records into the topology, committed as
    /// one change: a snapshot line by line (a line that fails, say an
    /// interface whose namespace is gone, is skipped and said), a request
    /// whole or not at all, as it was applied; lines about what the config
    /// owns (`owned`, by `config_keys`) are left out.
    fn restore(&self, state: &mut State, records: Vec<journal::Record>, owned: &HashSet<String>) -> Restored {
        let mut work = state.topo.clone();
        let mut r = Restored::default();
        let skip = |line: &str, why: &str, r: &mut Restored| {
            r.skipped += 1;
            tracing::warn!("state: not restored: {line}: {why}");
        };
        let parse = |l: &str| match parse_line(l) {
            Ok(Some(c)) if c.mutates() && c != Command::Reload => Ok(c),
            Ok(_) => Err("not a change".to_string()),
            Err(e) => Err(e),
        };
        let config_owns = |c: &Command| config_keys(c).iter().any(|k| owned.contains(k));
        for rec in records {
            match rec {
                journal::Record::Snapshot(lines) => {
                    for l in &lines {
                        let cmd = match parse(l) {
                            Ok(c) if config_owns(&c) => {
                                r.config += 1;
                                continue;
                            }
                            Ok(c) => c,
                            Err(e) => {
                                skip(l, &e, &mut r);
                                continue;
                            }
                        };
                        // A route that cannot be added changes nothing (its
                        // checks come first): no copy to fall back to, which
                        // would cost a table's size per route.
                        let before = (!matches!(cmd, Command::RouteAdd(..))).then(|| work.clone());
                        match work.apply(&cmd, &self.settings, &*self.dp) {
                            Ok(_) => r.changes += 1,
                            Err(e) => {
                                if let Some(b) = before {
                                    work = b;
                                }
                                skip(l, &e, &mut r);
                            }
                        }
                    }
                    work.ids.commit();
                }
                journal::Record::Request(lines) => {
                    let before = work.clone();
                    let mut mine = 0;
                    let applied: Result<usize, String> = lines.iter().try_fold(0, |n, l| {
                        let cmd = parse(l).map_err(|e| format!("{l}: {e}"))?;
                        if config_owns(&cmd) {
                            mine += 1;
                            return Ok(n);
                        }
                        work.apply(&cmd, &self.settings, &*self.dp).map_err(|e| format!("{l}: {e}"))?;
                        Ok(n + 1)
                    });
                    match applied {
                        Ok(n) => {
                            r.changes += n;
                            r.config += mine;
                            work.ids.commit();
                        }
                        Err(e) => {
                            work = before;
                            r.skipped += lines.len();
                            tracing::warn!("state: a request of {} change(s) not restored: {e}", lines.len());
                        }
                    }
                }
                journal::Record::Config(_) => {}
            }
        }
        let path = state.journal.as_ref().map_or(String::new(), |j| j.path().display().to_string());
        tracing::info!("state {path}: restored {} change(s), {} not, {} left to the config", r.changes, r.skipped, r.config);
        if r.changes > 0 || r.skipped > 0 {
            self.commit(state, work);
        }
        r
    }

    /// `RELOAD`: reads the config file again and applies, all or nothing,
    /// the difference from what was applied last.
    fn reload(&self, caller: &Caller) -> Result<Vec<String>, String> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let Some((path, applied)) = state.config.clone() else {
            return Err("line 1: vnetd was started without --config: there is nothing to reload: RELOAD".into());
        };
        let text = std::fs::read_to_string(&path).map_err(|e| format!("line 1: cannot read {}: {e}: RELOAD", path.display()))?;
        self.reload_locked(state, caller, &path, &text, applied)
    }

    /// Applies config `text`, all or nothing, as the difference from the
    /// changes `applied` last: what lines now gone had added is deleted
    /// (routes first, then links and interfaces), and new lines are applied
    /// in the file's order. Lines still there are left alone, and so is
    /// everything the config did not make (interfaces of the CNI plugin,
    /// the agent's links and routes). A removed SET line leaves its setting
    /// as it is.
    fn reload_locked(&self, state: &mut State, caller: &Caller, path: &Path, text: &str, applied: Vec<(usize, String)>) -> Result<Vec<String>, String> {
        // A config that does not parse changes nothing.
        parse_request(text).map_err(|e| format!("{}: {e}", path.display()))?;
        let now = config_changes(text);
        let (was, is): (HashSet<&str>, HashSet<&str>) =
            (applied.iter().map(|(_, l)| l.as_str()).collect(), now.iter().map(|(_, l)| l.as_str()).collect());
        let gone: Vec<&str> = applied.iter().map(|(_, l)| l.as_str()).filter(|l| !is.contains(l)).collect();
        // What a gone line added goes: routes first, then links and interfaces.
        let mut undo: Vec<(u8, String, &str)> = gone
            .iter()
            .filter_map(|l| {
                let cmd = vnet_core::command::parse_line(l).ok().flatten()?;
                let rank = match cmd {
                    Command::RouteAdd(..) => 0,
                    Command::LinkAdd { .. } => 1,
                    _ => 2,
                };
                cmd.undo().map(|u| (rank, u, *l))
            })
            .collect();
        undo.sort_by_key(|(rank, ..)| *rank);
        let new: Vec<&(usize, String)> = now.iter().filter(|(_, l)| !was.contains(l.as_str())).collect();
        // Each line of the request, and what it is in the file's terms.
        let request: Vec<(&str, String)> = undo
            .iter()
            .map(|(_, u, l)| (u.as_str(), format!("taking back '{l}'")))
            .chain(new.iter().map(|(n, l)| (l.as_str(), format!("line {n}"))))
            .collect();
        let mut out = vec![format!(
            "reload {}: {} line(s) gone, {} new, {} unchanged",
            path.display(),
            gone.len(),
            new.len(),
            now.len() - new.len()
        )];
        if !request.is_empty() {
            let who = Caller { role: caller.role, who: format!("{caller} reloading {}", path.display()) };
            let text: Vec<&str> = request.iter().map(|(l, _)| *l).collect();
            // A refusal names the request's line: say which line of the file that is.
            let applied = self.execute_locked(state, &text.join("\n"), &who).map_err(|e| {
                let at = e.strip_prefix("line ").and_then(|r| r.split_once(": ")).and_then(|(n, why)| Some((n.parse::<usize>().ok()?, why)));
                match at.and_then(|(n, why)| Some((&request.get(n.checked_sub(1)?)?.1, why))) {
                    Some((origin, why)) => format!("{}: {origin}: {why}", path.display()),
                    None => format!("{}: {e}", path.display()),
                }
            })?;
            out.extend(applied);
        }
        let now = (path.to_path_buf(), now);
        if let Some(j) = &mut state.journal {
            if let Err(e) = j.config(&now) {
                tracing::error!("{e:#}");
            }
        }
        state.config = Some(now);
        Ok(out)
    }
    /// Tears down, here on the control thread, the retired objects no
    /// dispatcher uses any more; the others wait for the next request.
    fn tear_down_retired(&self, retiring: &mut Vec<(u64, Retired)>) {
        let acknowledged = self.dp.acknowledged();
        let mut kept = Vec::new();
        for (generation, r) in retiring.drain(..) {
            if generation > acknowledged {
                kept.push((generation, r));
                continue;
            }
            // Every dispatcher runs a snapshot without it: this is the last
            // reference, unless a report holds one for a moment.
            match r {
                Retired::Iface(i, detach) => match Arc::try_unwrap(i) {
                    Ok(i) => {
                        if let Some(f) = &self.dp.fast {
                            f.forget_iface(i.id);
                        }
                        i.teardown()
                    }
                    Err(i) => kept.push((generation, Retired::Iface(i, detach))),
                },
                Retired::Link(l) => match Arc::try_unwrap(l) {
                    Ok(l) => {
                        if let Some(f) = &self.dp.fast {
                            f.forget_link(l.id);
                        }
                        let name = l.name.clone();
                        let waiting = l.teardown();
                        for _ in 0..waiting {
                            self.dp.control.drop_at(None, DropReason::Down);
                        }
                        if waiting > 0 {
                            tracing::info!(link = %name, "link deleted with {waiting} frame(s) unsent (counted as down)");
                        }
                    }
                    Err(l) => kept.push((generation, Retired::Link(l))),
                },
            }
        }
        if !kept.is_empty() {
            tracing::debug!("{} retired object(s) still in use; torn down after a later request", kept.len());
        }
        *retiring = kept;
    }

    /// Executes a request (one or more lines) for `caller`. On success
    /// returns the output lines; on failure returns `line N: reason: text`
    /// and nothing changed. A request with any change in it needs the admin
    /// role, and every applied change is logged with who made it.
    pub fn execute(&self, request: &str, caller: &Caller) -> Result<Vec<String>, String> {
        let cmds = parse_request(request).map_err(|e| e.to_string())?;
        let line_text = |line: usize| request.lines().nth(line - 1).unwrap_or("").trim();
        if let Some((line, _)) = cmds.iter().find(|(_, c)| *c == Command::Reload) {
            if cmds.len() > 1 {
                return Err(format!("line {line}: RELOAD must be a request of its own: {}", line_text(*line)));
            }
            if caller.role != Role::Admin {
                return Err(format!("line {line}: permission denied: {caller} may only read (SHOW, STATS, LIST, HELP): RELOAD"));
            }
            return self.reload(caller);
        }
        if let Some((line, Command::KindRequest { kind, verb })) = cmds.iter().find(|(_, c)| matches!(c, Command::KindRequest { .. })) {
            // A link kind's own request (`WIREGUARD ROTATE`): an admin's,
            // and alone.
            let shown = format!("{} {}", kind.to_uppercase(), verb.to_uppercase());
            if cmds.len() > 1 {
                return Err(format!("line {line}: {shown} must be a request of its own"));
            }
            if caller.role != Role::Admin {
                return Err(format!("line {line}: permission denied: {caller} may only read (SHOW, STATS, LIST, HELP): {shown}"));
            }
            let Some(k) = crate::link::kinds::named(kind) else { return Err(format!("line {line}: vnetd has no {kind} links")) };
            let out = k.command(verb, &*self.dp).map_err(|e| format!("line {line}: {e}"))?;
            tracing::info!("control: {caller} ran {shown}");
            self.settings.changes.bump();
            return Ok(out);
        }
        if caller.role != Role::Admin {
            if let Some((line, _)) = cmds.iter().find(|(_, c)| c.mutates()) {
                tracing::warn!("control: {caller}: refused a change: {}", line_text(*line));
                return Err(format!(
                    "line {line}: permission denied: {caller} may only read (SHOW, STATS, LIST, HELP): {}",
                    line_text(*line)
                ));
            }
        }
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.apply_locked(&mut guard, request, &cmds, caller)
    }

    /// Parses and applies a request under the state's lock (the config's).
    fn execute_locked(&self, state: &mut State, request: &str, caller: &Caller) -> Result<Vec<String>, String> {
        let cmds = parse_request(request).map_err(|e| e.to_string())?;
        self.apply_locked(state, request, &cmds, caller)
    }

    /// Executes a request whose caller may make it, under the state's lock:
    /// all or nothing; what it changed is in force, and recorded in the
    /// state file, when it returns.
    fn apply_locked(&self, state: &mut State, request: &str, cmds: &[(usize, Command)], caller: &Caller) -> Result<Vec<String>, String> {
        let line_text = |line: usize| request.lines().nth(line - 1).unwrap_or("").trim();
        self.tear_down_retired(&mut state.retiring);
        let mut work = state.topo.clone();
        let mut out = Vec::new();
        // The changes as the state file records them: canonical, and naming
        // objects, not ids (which a restore need not give again).
        let mut record = Vec::new();
        for (line, cmd) in cmds {
            if cmd.mutates() {
                let canonical = work.canonical(cmd).to_string();
                let msg = work
                    .apply(cmd, &self.settings, &*self.dp)
                    .map_err(|reason| format!("line {line}: {reason}: {}", line_text(*line)))?;
                out.push(msg);
                record.push(canonical);
            } else {
                self.report(cmd, &work, &mut out);
            }
        }
        if !record.is_empty() {
            self.commit(state, work);
            log_changes(caller, cmds, line_text);
            if let Some(j) = &mut state.journal {
                if let Err(e) = j.request(&record) {
                    tracing::error!("{e:#}: the change is in force, but a restart would not restore it");
                }
                if j.due() {
                    let script = state.topo.script();
                    if let Err(e) = j.compact(state.config.as_ref(), &script) {
                        tracing::error!("state file {}: cannot write a snapshot: {e:#}", j.path().display());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Puts a changed topology in force: publishes it (the snapshot settles
    /// which persistent TAPs stay) once every dispatcher runs it, takes
    /// back the kernel's entries it changed, and tears down what it retired.
    fn commit(&self, state: &mut State, mut work: Topology) {
        state.generation += 1;
        let generation = state.generation;
        work.ids.commit();
        self.dp.publish(work.snapshot(generation));
        // Every dispatcher runs the new table: none installs an old
        // answer any more. Take back the kernel's entries it changed.
        if let Some(fast) = &self.dp.fast {
            let snap = self.dp.snapshot();
            if let Err(e) = fast.kernel.set_enabled(snap.fast_on) {
                tracing::error!("fast path: cannot switch it: {e:#}");
            }
            fast.sync_neigh(snap.clone());
            if snap.fast_on {
                fast.revalidate(&snap);
            } else {
                fast.kernel.clear_flows();
            }
            for r in &work.removed_routes {
                fast.forget_route(*r);
            }
        }
        // Offloaded connections the change no longer carries end now.
        if let Some(v) = &self.vtoe {
            v.revalidate(&self.dp.snapshot());
        }
        // New TCP links start connecting once they are in force.
        for l in work.links.values() {
            l.transport.in_force();
        }
        work.removed_routes.clear();
        self.settings.changes.bump();
        state.retiring.extend(std::mem::take(&mut work.retired).into_iter().map(|r| (generation, r)));
        state.topo = work;
        self.tear_down_retired(&mut state.retiring);
    }

    fn report(&self, cmd: &Command, t: &Topology, out: &mut Vec<String>) {
        match cmd {
            Command::IfaceList => list_ifaces(t, out),
            Command::LinkList => list_links(t, out),
            Command::RouteList(mac) => list_routes(t, *mac, out),
            Command::NeighList => list_neighbours(t, out),
            Command::Stats(scope) => self.stats(*scope, t, out),
            Command::Show => {
                let udp = self.dp.udp_addrs();
                out.push(format!(
                    "vnetd version={} sockets={udp} default_mtu={} default_link_port={} dispatchers={} datapath_in_force={}",
                    env!("CARGO_PKG_VERSION"),
                    self.settings.default_mtu,
                    self.settings.default_link_port,
                    self.dp.worker_count(),
                    // What `SET datapath` (auto by default) comes to here.
                    match (&self.dp.fast, t.dispatch.datapath) {
                        (None, _) => "user (kernel fast path not loaded)",
                        (Some(_), vnet_core::command::Datapath::User) => "user",
                        (Some(_), _) => "kernel",
                    }
                    .replace(' ', "_")
                ));
                out.push(format!("settings {}", t.dispatch.render()));
                out.extend(self.dp.kinds_show());
                match &self.vtoe {
                    Some(v) => {
                        out.push(v.describe());
                        v.render_conns(out);
                    }
                    None => out.push("vtoe enabled=no".to_string()),
                }
                list_ifaces(t, out);
                list_links(t, out);
                list_routes(t, None, out);
            }
            Command::Help => out.extend(HELP.lines().map(String::from)),
            _ => {}
        }
    }

    fn stats(&self, scope: StatsScope, t: &Topology, out: &mut Vec<String>) {
        let all = scope == StatsScope::All;
        if all || scope == StatsScope::Global {
            let [global, offload, dispatch] = self.dp.totals();
            // The fast path's frames, summed over every port it counted.
            let fast_in = self.dp.fast.as_ref().map_or((0, 0), |f| {
                let hit = t.ifaces.values().map(|i| f.port(i.id, false)).chain(t.links.values().map(|l| f.port(l.id, true)));
                hit.fold((0, 0), |(fr, by), p| (fr + p.in_frames, by + p.in_bytes))
            });
            out.push(format!("global {global}"));
            out.push(format!("paths user_frames={} kernel_frames={} kernel_bytes={}", self.dp.user_frames(), fast_in.0, fast_in.1));
            out.push(format!("offload {offload}"));
            out.push(format!("dispatch {dispatch}"));
            out.push(match &self.dp.fast {
                Some(f) => f.render(t.dispatch.datapath),
                None => "fastpath loaded=no".to_string(),
            });
            for k in crate::link::kinds::ALL {
                if let Some(line) = k.stats(&*self.dp) {
                    out.push(format!("{}{line}", k.word()));
                }
            }
        }
        if all || scope == StatsScope::Interfaces {
            for i in t.ifaces.values() {
                let configured = t.iface_settings.get(&i.id).copied().unwrap_or_default().effective(&t.dispatch).mode;
                let running = if i.running_mode.load(Relaxed) == Mode::VmmDriven as u8 { Mode::VmmDriven } else { Mode::GuestDriven };
                out.push(format!(
                    "interface {} name={} mode={} running={} mode_switches={} {} drop_upcall_full={} fast_neigh_answered={}{}",
                    i.id,
                    i.name,
                    configured.name(),
                    running.name(),
                    i.mode_switches.load(Relaxed),
                    i.stats.render_plus(self.dp.fast.as_ref().map(|f| f.port(i.id, false)).unwrap_or_default()),
                    i.nic.upcall_dropped(),
                    self.dp.fast.as_ref().map_or(0, |f| f.neigh_answered(i.id)),
                    i.nic.extra_stats()
                ));
            }
        }
        if all || scope == StatsScope::Links {
            for l in t.links.values() {
                let fast = self.dp.fast.as_ref().map(|f| f.port(l.id, true)).unwrap_or_default();
                let resolved = self.dp.fast.as_ref().map_or(0, |f| f.resolved(l.id));
                out.push(format!(
                    "link {} name={} {} fast_resolved_frames={resolved}{}",
                    l.id,
                    l.name,
                    l.stats.render_plus(fast),
                    l.transport.extra_stats()
                ));
            }
        }
        if all || scope == StatsScope::Vtoe {
            match &self.vtoe {
                Some(v) => v.render(out),
                None if scope == StatsScope::Vtoe => out.push("vtoe enabled=no".to_string()),
                None => {}
            }
        }
        if all || scope == StatsScope::Routes {
            for r in t.routes.values() {
                let (ff, fb) = self.dp.fast.as_ref().map_or((0, 0), |f| f.route(r.id));
                out.push(format!(
                    "route {} frames={} bytes={} fast_frames={ff} rule={}",
                    r.id,
                    r.stats.out_frames.load(Relaxed) + ff,
                    r.stats.out_bytes.load(Relaxed) + fb,
                    r.spec
                ));
            }
        }
    }

    /// Removes every interface (and so every TAP vnetd made, QEMU's too);
    /// called once the dispatcher has stopped.
    /// Tears everything down, after the dispatchers stopped.
    pub fn shutdown(&self) {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let topo = std::mem::take(&mut state.topo);
        self.dp.clear();
        // Persistent TAPs in force stay when vnetd exits (their fate was
        // settled when they were added); only their file side closes.
        state.retiring.extend(topo.links.into_values().map(|l| (0, Retired::Link(l))));
        state.retiring.extend(topo.ifaces.into_values().map(|i| (0, Retired::Iface(i, true))));
        self.tear_down_retired(&mut state.retiring);
    }

    /// Routes in force.
    pub fn route_count(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).topo.routes.len()
    }

    /// Drops of one reason over the whole daemon (for the log at exit).
    pub fn total_drops(&self, why: DropReason) -> u64 {
        self.dp.total_drops(why)
    }
}

/// What a change is about, as the config owns it: an interface (by name
/// and by MAC), a link (by name), a route (by rule), a setting (by key),
/// an interface's own setting (by interface and key).
fn config_keys(c: &Command) -> Vec<String> {
    use vnet_core::command::{IfaceRef, LinkRef, RouteRef};
    let iface = |r: &IfaceRef| match r {
        IfaceRef::Name(n) => format!("iface {n}"),
        IfaceRef::Mac(m) => format!("mac {m}"),
    };
    match c {
        Command::IfaceAdd { name, mac, .. } => vec![format!("iface {name}"), format!("mac {mac}")],
        Command::IfaceDel(r, _) => vec![iface(r)],
        Command::IfaceSet(r, s) => vec![format!("{} {}", iface(r), s.key_value().0)],
        Command::LinkAdd { .. } => c.link_name().map(|n| vec![format!("link {n}")]).unwrap_or_default(),
        Command::LinkDel(LinkRef::Name(n)) => vec![format!("link {n}")],
        Command::RouteAdd(spec, _) | Command::RouteDel(RouteRef::Rule(spec)) => vec![format!("route {spec}")],
        Command::Set(s) => vec![format!("set {}", s.key_value().0)],
        _ => Vec::new(),
    }
}

/// The changes a config file holds, with their line numbers, each as
/// written (comments and spacing aside): what `RELOAD` compares.
fn config_changes(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.split('#').next().unwrap_or("").split_whitespace().collect::<Vec<_>>().join(" ")))
        .filter(|(_, l)| matches!(vnet_core::command::parse_line(l), Ok(Some(c)) if c.mutates()))
        .collect()
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
    // What each guest holds: what it said of itself (learned), and what is
    // bound to its MAC (a CNI plugin binds its IPAM addresses).
    let macs: Vec<_> = t.ifaces.values().map(|i| i.mac).collect();
    let bound = t.neighbours.bound_to(&macs);
    for i in t.ifaces.values() {
        let own = t.iface_settings.get(&i.id).copied().unwrap_or_default().render();
        let attach = i.attach.word();
        let netns = i.netns.as_ref().map_or(String::new(), |n| format!(" netns={n}"));
        let netns = format!("{netns} network={}", i.network);
        let nic = i.nic.describe();
        let nic = if nic.is_empty() { nic } else { format!(" {nic}") };
        let mut ips = i.learned.list();
        for (_, ip) in bound.iter().filter(|(m, _)| *m == i.mac) {
            if !ips.contains(ip) {
                ips.push(*ip);
            }
        }
        let ips = if ips.is_empty() { String::new() } else { format!(" ips={}", ips.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",")) };
        out.push(format!("interface {} name={} mac={} mtu={} attach={attach}{netns}{nic}{ips} {own}", i.id, i.name, i.mac, i.mtu));
    }
}

/// `NEIGH LIST`: the bindings given, then those learned from local guests
/// (`learned=<interface>`).
fn list_neighbours(t: &Topology, out: &mut Vec<String>) {
    for (ip, b) in t.neighbours.sorted() {
        match b.owner {
            Some(o) => out.push(format!("neigh {ip} {} owner {o}", b.mac)),
            None => out.push(format!("neigh {ip} {}", b.mac)),
        }
    }
    for i in t.ifaces.values() {
        for ip in i.learned.list() {
            out.push(format!("neigh {ip} {} learned={}", i.mac, i.name));
        }
    }
}

fn list_links(t: &Topology, out: &mut Vec<String>) {
    for l in t.links.values() {
        let remote = l.remote.map_or(String::new(), |r| format!(" remote={r}"));
        let extra = l.transport.describe();
        let vtoe = l.vtoe.as_ref().map_or(String::new(), |(name, _)| format!(" vtoe={name}"));
        out.push(format!(
            "link {} name={} proto={}{remote} mtu={} max_frame={}{extra}{vtoe}",
            l.id,
            l.name,
            l.transport.kind(),
            l.mtu,
            l.max_frame
        ));
    }
}

fn list_routes(t: &Topology, mac: Option<vnet_core::Mac>, out: &mut Vec<String>) {
    for r in t.routes.values().filter(|r| mac.is_none_or(|m| r.spec.names(m))) {
        match &r.owner {
            Some(o) => out.push(format!("route {} {} owner {o}", r.id, r.spec)),
            None => out.push(format!("route {} {}", r.id, r.spec)),
        }
    }
}
