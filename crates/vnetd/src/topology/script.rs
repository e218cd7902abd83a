//! The topology written as the control language: what the state file
//! records (`control::journal`), so that a vnetd started again restores it.

use super::Topology;
use vnet_core::command::{Command, IfaceRef, IfaceSetting, LinkRef, RouteRef, Setting};
use vnet_core::table::Port;

impl Topology {
    /// `cmd` as the state file records it: naming objects, not ids (a
    /// vnetd started again gives them ids of its own when nothing pinned
    /// outlived this one).
    pub fn canonical(&self, cmd: &Command) -> Command {
        match cmd {
            Command::LinkDel(LinkRef::Index(i)) => match self.links.get(i) {
                Some(l) => Command::LinkDel(LinkRef::Name(l.name.clone())),
                None => cmd.clone(),
            },
            Command::RouteDel(RouteRef::Index(i)) => match self.routes.get(i) {
                Some(r) => Command::RouteDel(RouteRef::Rule(r.spec.clone())),
                None => cmd.clone(),
            },
            _ => cmd.clone(),
        }
    }

    /// Every setting and object, one line each, in an order that applies
    /// on a fresh vnetd: settings, interfaces with their own settings,
    /// links, routes (each kind by id).
    pub fn script(&self) -> Vec<String> {
        let mut out: Vec<String> = self.dispatch.changes().into_iter().map(|s| Command::Set(s).to_string()).collect();
        for (id, i) in &self.ifaces {
            let Some(made) = self.made_by.get(&Port::Interface(*id)) else { continue };
            out.push(made.to_string());
            if let Some(o) = self.iface_settings.get(id) {
                let r = || IfaceRef::Name(i.name.clone());
                // Thresholds as `changes` orders them: each step valid.
                let upper_first = o.alpha_lower.is_some_and(|l| l >= self.dispatch.alpha_upper);
                let mut sets = vec![IfaceSetting::Mode(o.mode), IfaceSetting::AlphaLower(o.alpha_lower), IfaceSetting::AlphaUpper(o.alpha_upper)];
                if upper_first {
                    sets.swap(1, 2);
                }
                sets.push(IfaceSetting::WindowMs(o.window_ms));
                let defaults = [IfaceSetting::Mode(None), IfaceSetting::AlphaLower(None), IfaceSetting::AlphaUpper(None), IfaceSetting::WindowMs(None)];
                out.extend(sets.into_iter().filter(|s| !defaults.contains(s)).map(|s| Command::IfaceSet(r(), s).to_string()));
            }
        }
        out.extend(self.links.keys().filter_map(|id| self.made_by.get(&Port::Link(*id))).map(|c| c.to_string()));
        out.extend(self.routes.values().map(|r| Command::RouteAdd(r.spec.clone(), r.owner.clone()).to_string()));
        out.extend(self.neighbours.sorted().into_iter().map(|(ip, b)| Command::NeighAdd { ip, mac: b.mac, owner: b.owner }.to_string()));
        out
    }
}

impl crate::settings::DispatchSettings {
    /// The `SET`s that make these settings from the defaults, ordered so
    /// that each leaves the thresholds valid (α_l below α_u, α below β).
    pub fn changes(&self) -> Vec<Setting> {
        let d = Self::default();
        let mut out = Vec::new();
        let mut push = |differs: bool, s: Setting| {
            if differs {
                out.push(s)
            }
        };
        push(self.mode != d.mode, Setting::Mode(self.mode));
        push(self.yield_strategy != d.yield_strategy, Setting::Yield(self.yield_strategy));
        push(self.sleep_us != d.sleep_us, Setting::SleepUs(self.sleep_us));
        push(self.nowork_us != d.nowork_us, Setting::NoworkUs(self.nowork_us));
        let (lower, upper) = (Setting::AlphaLower(self.alpha_lower), Setting::AlphaUpper(self.alpha_upper));
        let pair = if self.alpha_lower >= d.alpha_upper { [upper, lower] } else { [lower, upper] };
        for s in pair {
            push(s != Setting::AlphaLower(d.alpha_lower) && s != Setting::AlphaUpper(d.alpha_upper), s);
        }
        push(self.window_ms != d.window_ms, Setting::WindowMs(self.window_ms));
        push(self.quota != d.quota, Setting::Quota(self.quota));
        push(self.datapath != d.datapath, Setting::Datapath(self.datapath));
        push(self.interrupts != d.interrupts, Setting::Interrupts(self.interrupts));
        let (a, b) = (Setting::EocAlpha(self.eoc_alpha), Setting::EocBeta(self.eoc_beta));
        let pair = if self.eoc_alpha >= d.eoc_beta { [b, a] } else { [a, b] };
        for s in pair {
            push(s != Setting::EocAlpha(d.eoc_alpha) && s != Setting::EocBeta(d.eoc_beta), s);
        }
        push(self.cut_through != d.cut_through, Setting::CutThrough(self.cut_through));
        push(self.storm_pps != d.storm_pps, Setting::StormPps(self.storm_pps));
        out
    }
}
