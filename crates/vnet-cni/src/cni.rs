//! The CNI commands: ADD, DEL, CHECK, STATUS, GC and VERSION.

use crate::config::{at_least, checked_version, parse_json, CniEnv, NetConf, Routes, LATEST_VERSION, SUPPORTED_VERSIONS};
use crate::error::{code, invalid_config, CniError, CniResult};
use crate::ipam::{self, Ipam};
use crate::names;
use crate::netns::{self, Netns};
use crate::result::{AddResult, Interface};
use crate::state::{Record, Store};
use crate::vnetd::{Vnetd, VnetdError};
use serde_json::{json, Value};
use std::collections::HashSet;
use vnet_core::Mac;

/// The owner tag of the routes the plugin adds: vnetd deletes them with
/// the interface they deliver to.
pub const OWNER: &str = "cni";

/// Runs one command. `version` is set to the config's version as soon as
/// it is known, for the error to be written in. `Ok(Some(_))` is printed.
pub fn dispatch(command: &str, stdin: &[u8], version: &mut String) -> CniResult<Option<Value>> {
    if command == "VERSION" {
        return Ok(Some(version_result(stdin)));
    }
    if !matches!(command, "ADD" | "DEL" | "CHECK" | "STATUS" | "GC") {
        return Err(CniError::new(
            code::INVALID_ENV,
            format!("CNI_COMMAND \"{command}\" is unknown (want ADD, DEL, CHECK, STATUS, GC or VERSION)"),
        ));
    }
    if let Some(v) = parse_json(stdin).ok().and_then(|v| checked_version(&v).ok()) {
        *version = v;
    }
    let conf = NetConf::parse(stdin)?;
    // CHECK came with 0.4.0, STATUS and GC with 1.1.0.
    let since = match command {
        "CHECK" => "0.4.0",
        "STATUS" | "GC" => "1.1.0",
        _ => "0.0.0",
    };
    if !at_least(&conf.cni_version, since) {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!("config version {} does not allow {command} (it needs {since} or later)", conf.cni_version),
        ));
    }
    let env = CniEnv::read(command, |k| std::env::var(k).ok())?;
    match command {
        "ADD" => add(&conf, &env).map(Some),
        "DEL" => del(&conf, &env).map(|_| None),
        "CHECK" => check(&conf, &env).map(|_| None),
        "STATUS" => status(&conf).map(|_| None),
        _ => gc(&conf).map(|_| None),
    }
}

/// VERSION: the versions the plugin speaks, in the version asked about.
fn version_result(stdin: &[u8]) -> Value {
    let asked = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| Some(v.get("cniVersion")?.as_str()?.to_string()))
        .unwrap_or_else(|| LATEST_VERSION.to_string());
    json!({ "cniVersion": asked, "supportedVersions": SUPPORTED_VERSIONS })
}

/// The container's MAC: the runtime's (`mac` capability), else CNI_ARGS
/// `MAC=` (podman's `--mac-address`), else derived from the attachment.
pub fn choose_mac(conf: &NetConf, env: &CniEnv) -> CniResult<Mac> {
    if let Some(m) = conf.runtime_mac {
        return Ok(m);
    }
    if let Some(m) = env.arg("MAC") {
        return crate::config::unicast_mac(m).map_err(|e| CniError::new(code::INVALID_ENV, format!("CNI_ARGS MAC: {e}")));
    }
    Ok(names::derived_mac(&env.container_id, &env.ifname))
}

/// Whether `mac` is free for container interface `interface`: no other
/// interface of this host's vnetd has it, and no guest of the overlay holds
/// it (the `macsFile` vnet-agent keeps, when configured). A tenant picking
/// its MAC (`MAC=`, `runtimeConfig.mac`) must not take another guest's.
/// Read under the state lock, so two ADDs on this host cannot both pass.
pub fn check_mac_free(conf: &NetConf, interface: &str, mac: Mac, local: &[crate::vnetd::Iface]) -> CniResult<()> {
    let m = mac.to_string();
    let in_use = |msg: String| CniError::new(code::MAC_IN_USE, format!("MAC {m} is in use: {msg}"));
    if let Some(i) = local.iter().find(|i| i.mac == m && i.name != interface) {
        return Err(in_use(format!("vnetd's interface {} on this host has it", i.name)));
    }
    if local.iter().any(|i| i.name == interface) {
        // This attachment's own interface (an ADD repeated): vnetd says.
        return Ok(());
    }
    let Some(f) = &conf.macs_file else { return Ok(()) };
    let text = std::fs::read_to_string(f).map_err(|e| {
        CniError::new(code::TRY_AGAIN_LATER, format!("macsFile {}: {e} (is vnet-agent running with --macs-file?)", f.display()))
    })?;
    for line in text.lines() {
        let mut w = line.split(' ');
        if w.next() == Some(m.as_str()) {
            let (host, net) = (w.next().unwrap_or("?"), w.next().unwrap_or("?"));
            return Err(in_use(format!("a guest of host {host} in network {net} holds it (vnet-agent's {})", f.display())));
        }
    }
    Ok(())
}

/// The one request that makes the attachment in vnetd: the veth (its guest
/// end `ifname` in the container's namespace) and, with `routes: local`,
/// the rules that deliver frames to it, owner-tagged so that they go with it.
pub fn vnetd_commands(interface: &str, mac: Mac, conf: &NetConf, netns: &str, ifname: &str) -> Vec<String> {
    let mut lines = vec![format!(
        "INTERFACE ADD {interface} {mac} mtu {} netns {netns} veth ifname {ifname} network {}",
        conf.mtu, conf.network
    )];
    if conf.routes == Routes::Local {
        lines.push(format!("ROUTE ADD any {mac} interface {mac} any owner {OWNER}"));
        lines.push(format!("ROUTE ADD any ff:ff:ff:ff:ff:ff interface {mac} any owner {OWNER}"));
    }
    lines
}

/// With `routes: local`, what IPv6 needs besides: neighbour discovery
/// asks for an address at its solicited-node multicast MAC (33:33:ff and
/// the address's last 24 bits), which the broadcast rule does not cover.
/// One rule per IPv6 address delivers those to the container, as the
/// broadcast rule does ARP.
pub fn neighbour_routes(mac: Mac, ipam: &AddResult) -> Vec<String> {
    let mut lines: Vec<String> = ipam
        .ips
        .iter()
        .filter_map(|ip| match ip.address.addr {
            std::net::IpAddr::V6(a) => {
                let o = a.octets();
                let group = Mac([0x33, 0x33, 0xff, o[13], o[14], o[15]]);
                Some(format!("ROUTE ADD any {group} interface {mac} any owner {OWNER}"))
            }
            std::net::IpAddr::V4(_) => None,
        })
        .collect();
    lines.sort();
    lines.dedup();
    lines
}

/// The IPAM plugin's addresses bound to the container's MAC, as soon as
/// IPAM has answered, before the container sends anything: its host's
/// vnetd answers ARP and neighbour solicitations for them, and vnet-agent
/// publishes them with the container's MAC claim, so that every host of
/// its network answers them too (docs/controller.md, "Broadcast kept at
/// home"). Owner-tagged: they go with the interface.
pub fn address_bindings(mac: Mac, ipam: &AddResult) -> Vec<String> {
    let mut lines: Vec<String> = ipam.ips.iter().map(|ip| format!("NEIGH ADD {} {mac} owner {OWNER}", ip.address.addr)).collect();
    lines.sort();
    lines.dedup();
    lines
}

/// The result of this plugin's own work: the container interface and the
/// IPAM plugin's addresses on it. The config's `dns`, if any, is preferred
/// to the IPAM plugin's (as the reference plugins do).
pub fn container_result(conf: &NetConf, ifname: &str, mac: Mac, sandbox: &str, ipam: AddResult) -> AddResult {
    let mut r = ipam;
    r.interfaces = vec![Interface {
        name: ifname.to_string(),
        mac: Some(mac.to_string()),
        mtu: Some(conf.mtu),
        sandbox: Some(sandbox.to_string()),
        ..Interface::default()
    }];
    for ip in &mut r.ips {
        ip.interface = Some(0);
    }
    if let Some(dns) = conf.dns.as_ref().and_then(Value::as_object) {
        r.dns = Some(dns.clone());
    }
    r
}

/// A prevResult (a plugin before this one in the chain) with ours after
/// it, our interface indexes moved past its interfaces.
pub fn merge(prev: Option<AddResult>, ours: AddResult) -> AddResult {
    let Some(mut out) = prev else { return ours };
    let offset = out.interfaces.len();
    out.interfaces.extend(ours.interfaces);
    out.ips.extend(ours.ips.into_iter().map(|mut ip| {
        ip.interface = ip.interface.map(|i| i + offset);
        ip
    }));
    out.routes.extend(ours.routes);
    if ours.dns.as_ref().is_some_and(|d| !d.is_empty()) {
        out.dns = ours.dns;
    }
    out
}

fn prev_result(conf: &NetConf) -> CniResult<Option<AddResult>> {
    conf.prev_result
        .as_ref()
        .map(|v| AddResult::parse(v).map_err(|e| CniError::new(code::DECODING_FAILED, format!("prevResult: {e}"))))
        .transpose()
}

/// What a failed ADD has made so far, and takes back.
struct Undo<'a> {
    conf: &'a NetConf,
    bound: Option<String>,
    interface: Option<String>,
    ipam: Option<Ipam>,
}

impl Undo<'_> {
    fn rollback(self) {
        if let Some(name) = &self.interface {
            let del = Vnetd::connect(&self.conf.socket).and_then(|mut v| v.request(&format!("INTERFACE DEL {name}\n")));
            if let Err(e) = del {
                eprintln!("vnet-cni: undoing ADD: cannot delete interface {name} from vnetd: {}", CniError::from(e));
            }
        }
        if let Some(ipam) = &self.ipam {
            if let Err(e) = ipam.del(None) {
                eprintln!("vnet-cni: undoing ADD: IPAM DEL failed: {e}");
            }
        }
        if let Some(name) = &self.bound {
            if let Err(e) = netns::unbind(name) {
                eprintln!("vnet-cni: undoing ADD: {e}");
            }
        }
    }
}

/// ADD: the veth and its routes in vnetd (one request), the IPAM plugin's
/// addresses and routes on the device, then the record. If a step fails,
/// what the earlier ones made is taken back: nothing is left behind.
fn add(conf: &NetConf, env: &CniEnv) -> CniResult<Value> {
    let sandbox = env.netns.as_deref().expect("ADD has CNI_NETNS (checked)");
    let prev = prev_result(conf)?;
    let mac = choose_mac(conf, env)?;
    let store = Store::new(&conf.state_dir);
    let _lock = store.lock()?;
    let ns = netns::resolve(sandbox, &names::netns_mount_name(&env.container_id, &env.ifname))?;
    let mut undo = Undo { conf, bound: ns.made.then(|| ns.name.clone()), interface: None, ipam: None };
    match add_steps(conf, env, &ns, mac, prev, &store, &mut undo) {
        Ok(v) => Ok(v),
        Err(e) => {
            undo.rollback();
            Err(e)
        }
    }
}

fn add_steps(
    conf: &NetConf,
    env: &CniEnv,
    ns: &Netns,
    mac: Mac,
    prev: Option<AddResult>,
    store: &Store,
    undo: &mut Undo,
) -> CniResult<Value> {
    let sandbox = env.netns.as_deref().expect("ADD has CNI_NETNS");
    let interface = names::interface_name(&env.container_id, &env.ifname);
    let mut commands = vnetd_commands(&interface, mac, conf, &ns.name, &env.ifname);
    let ipam = Ipam::of(conf)?; // found (or not) before anything changes
    let mut vnetd = Vnetd::connect(&conf.socket)?;
    check_mac_free(conf, &interface, mac, &vnetd.interfaces()?)?;
    vnetd.apply(&commands)?;
    undo.interface = Some(interface.clone());

    let ipam_result = match ipam {
        // Set before ADD runs: a failed ADD is followed by DEL (spec, section 4).
        Some(ipam) => undo.ipam.insert(ipam).add()?,
        None => AddResult::default(),
    };
    // Known only now that IPAM has answered; owner-tagged like the others,
    // so the interface's deletion (or the undo) takes them.
    let mut later = address_bindings(mac, &ipam_result);
    if conf.routes == Routes::Local {
        later.extend(neighbour_routes(mac, &ipam_result));
    }
    if !later.is_empty() {
        Vnetd::connect(&conf.socket)?.apply(&later)?;
        commands.extend(later);
    }
    let ours = container_result(conf, &env.ifname, mac, sandbox, ipam_result);
    netns::configure(&ns.name, &env.ifname, &ours)?;

    store.save(&Record {
        container_id: env.container_id.clone(),
        ifname: env.ifname.clone(),
        cni_network: conf.name.clone(),
        netns: sandbox.to_string(),
        netns_name: ns.name.clone(),
        netns_bound: ns.bound,
        socket: conf.socket.clone(),
        interface,
        mac: mac.to_string(),
        network: conf.network.clone(),
        mtu: conf.mtu,
        routes: conf.routes,
        commands,
    })?;
    Ok(merge(prev, ours).to_json(&conf.cni_version))
}

/// DEL: takes away what ADD made; see `remove`.
fn del(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    let store = Store::new(&conf.state_dir);
    let _lock = store.lock()?;
    let record = store.load(&conf.name, &env.container_id, &env.ifname).unwrap_or_else(|e| {
        eprintln!("vnet-cni: DEL goes on without the record: {e}");
        None
    });
    remove(conf, &store, &env.container_id, &env.ifname, record, None)
}

/// Removes an attachment, as much of it as can be, and succeeds if
/// nothing of it is left (missing pieces are fine: DEL is idempotent):
///
/// 1. vnetd's interface (`INTERFACE DEL`, which takes its owner-tagged
///    routes and the veth pair). Named as recorded, or without a record as
///    ADD would have named it. If vnetd is down, the device in the
///    container's namespace is deleted directly (taking the host end with
///    it), and the record goes, so that `restore` will not bring it back;
///    likewise if vnetd answers but does not hold it (restarted, not yet
///    restored: the pair outlived the old vnetd).
///    If vnetd refuses, that is the error, and the record stays.
/// 2. IPAM DEL (for GC, with `gc_env`: the stale attachment's variables).
/// 3. The /run/netns bind mount, if the plugin made one.
/// 4. The record.
fn remove(
    conf: &NetConf,
    store: &Store,
    container_id: &str,
    ifname: &str,
    record: Option<Record>,
    gc_env: Option<ipam::Attachment>,
) -> CniResult<()> {
    let interface = record.as_ref().map_or_else(|| names::interface_name(container_id, ifname), |r| r.interface.clone());
    let socket = record.as_ref().map_or_else(|| conf.socket.clone(), |r| r.socket.clone());
    let mut errors = Vec::new();
    let mut keep_record = false;

    match delete_interface(&socket, &interface, record.as_ref().map(|r| r.mac.as_str())) {
        Ok(true) => {}
        Ok(false) => {
            // vnetd does not hold it: it restarted and `restore` has not run
            // (yet). The veth pair outlived the old vnetd, so it goes as
            // when vnetd is down.
            if let Some(r) = &record {
                if let Err(e) = delete_device(r) {
                    errors.push(CniError::new(code::CONTAINER_SETUP, e));
                }
            }
        }
        Err(VnetdError::Refused(m)) => {
            keep_record = true;
            errors.push(CniError::from(VnetdError::Refused(m)));
        }
        Err(VnetdError::Unreachable(m)) => {
            eprintln!("vnet-cni: {m}; removing the container's device directly");
            if let Some(r) = &record {
                if let Err(e) = delete_device(r) {
                    errors.push(CniError::new(code::CONTAINER_SETUP, e));
                }
            }
        }
    }

    match Ipam::of(conf) {
        Ok(Some(ipam)) => {
            if let Err(e) = ipam.del(gc_env.as_ref()) {
                errors.push(e);
            }
        }
        Ok(None) => {}
        Err(e) => errors.push(e),
    }

    let bound = match &record {
        Some(r) => r.netns_bound.then(|| r.netns_name.clone()),
        None => Some(names::netns_mount_name(container_id, ifname)), // unbind takes "nothing there"
    };
    if let Some(name) = bound {
        if let Err(e) = netns::unbind(&name) {
            errors.push(CniError::new(code::CONTAINER_SETUP, e));
        }
    }

    if !keep_record {
        if let Err(e) = store.remove(&conf.name, container_id, ifname) {
            errors.push(e);
        }
    }
    combine(errors)
}

/// `INTERFACE DEL` of the attachment's interface, if vnetd holds it (and,
/// when the record says which MAC, with that MAC: another's is left alone).
/// `Ok(false)`: vnetd holds no interface of that name.
fn delete_interface(socket: &std::path::Path, name: &str, mac: Option<&str>) -> Result<bool, VnetdError> {
    let mut v = Vnetd::connect(socket)?;
    match v.interface(name)? {
        None => Ok(false),
        Some(i) if mac.is_some_and(|m| m != i.mac) => {
            eprintln!("vnet-cni: vnetd's interface {name} has MAC {}, not the recorded {}: left alone", i.mac, mac.unwrap_or(""));
            Ok(true)
        }
        Some(_) => v.request(&format!("INTERFACE DEL {name}\n")).map(|_| true),
    }
}

/// The container's device, deleted without vnetd, if it is still there
/// with the recorded MAC.
fn delete_device(r: &Record) -> Result<(), String> {
    if !netns::is_netns(&netns::path_of(&r.netns_name)) {
        return Ok(()); // the namespace, and the device with it, is gone
    }
    match netns::device(&r.netns_name, &r.ifname)? {
        Some(d) if d.mac == r.mac => netns::delete_device(&r.netns_name, &r.ifname),
        _ => Ok(()),
    }
}

/// One error from several: the first one's code, every message.
fn combine(errors: Vec<CniError>) -> CniResult<()> {
    let mut it = errors.into_iter();
    let Some(mut first) = it.next() else { return Ok(()) };
    for e in it {
        first.msg = format!("{}; {}", first.msg, e.msg);
    }
    Err(first)
}

/// CHECK: the attachment is as ADD left it, against the prevResult: vnetd
/// holds the interface with the recorded MAC, network and namespace; the
/// device is in the namespace, up, with that MAC and the prevResult's
/// addresses; the prevResult's routes are there; the IPAM plugin agrees.
fn check(conf: &NetConf, env: &CniEnv) -> CniResult<()> {
    let sandbox = env.netns.as_deref().expect("CHECK has CNI_NETNS (checked)");
    let prev = prev_result(conf)?.ok_or_else(|| invalid_config("CHECK needs prevResult (the result of ADD)"))?;
    let failed = |m: String| CniError::new(code::CHECK_FAILED, m);
    let store = Store::new(&conf.state_dir);
    let record = {
        let _lock = store.lock()?;
        store.load(&conf.name, &env.container_id, &env.ifname)?
    };
    let r = record.ok_or_else(|| {
        failed(format!(
            "no record of attachment {}/{} in {}: not added by vnet-cni, or deleted",
            env.container_id,
            env.ifname,
            conf.state_dir.display()
        ))
    })?;
    if r.netns != sandbox {
        return Err(failed(format!("CNI_NETNS is {sandbox}, but ADD was given {}", r.netns)));
    }

    let i = Vnetd::connect(&r.socket)?
        .interface(&r.interface)?
        .ok_or_else(|| failed(format!("vnetd on {} has no interface {}", r.socket.display(), r.interface)))?;
    let want = [("mac", &r.mac), ("network", &r.network), ("attach", &"veth".to_string()), ("netns", &r.netns_name), ("ifname", &r.ifname)];
    let got = [&i.mac, &i.network, &i.attach, &i.netns, &i.ifname];
    for ((what, want), got) in want.iter().zip(got) {
        if *want != got {
            return Err(failed(format!("vnetd's interface {} has {what} {got}, not {want}", r.interface)));
        }
    }

    let (index, pif) = prev
        .interfaces
        .iter()
        .enumerate()
        .find(|(_, i)| i.name == env.ifname && i.sandbox.as_deref() == Some(sandbox))
        .ok_or_else(|| failed(format!("prevResult has no interface {} in {sandbox}", env.ifname)))?;
    if pif.mac.as_deref().map(str::to_ascii_lowercase).as_deref() != Some(r.mac.as_str()) {
        return Err(failed(format!("prevResult gives {} MAC {:?}, but vnetd routes {}", env.ifname, pif.mac, r.mac)));
    }
    if !netns::is_netns(&netns::path_of(&r.netns_name)) {
        return Err(failed(format!("network namespace {} is gone", r.netns_name)));
    }
    let dev = netns::device(&r.netns_name, &env.ifname)
        .map_err(failed)?
        .ok_or_else(|| failed(format!("there is no device {} in {sandbox}", env.ifname)))?;
    if dev.mac != r.mac {
        return Err(failed(format!("device {} has MAC {}, not {}", env.ifname, dev.mac, r.mac)));
    }
    if !dev.up {
        return Err(failed(format!("device {} is down", env.ifname)));
    }
    for ip in prev.ips.iter().filter(|ip| ip.interface == Some(index)) {
        if !netns::has_address(&dev, &ip.address) {
            return Err(failed(format!("device {} does not have address {}", env.ifname, ip.address)));
        }
    }
    for v4 in [true, false] {
        let wanted: Vec<_> = prev.routes.iter().filter(|r| r.dst.is_v4() == v4).collect();
        if wanted.is_empty() {
            continue;
        }
        let have = netns::route_destinations(&r.netns_name, v4).map_err(failed)?;
        if let Some(missing) = wanted.iter().find(|w| !have.contains(&w.dst.network())) {
            return Err(failed(format!("there is no route to {} in {sandbox}", missing.dst)));
        }
    }

    if let Some(ipam) = Ipam::of(conf)? {
        ipam.check()?;
    }
    Ok(())
}

/// STATUS: ready if vnetd answers (`SHOW`) and the IPAM plugin is ready.
fn status(conf: &NetConf) -> CniResult<()> {
    if let Err(e) = Vnetd::connect(&conf.socket).and_then(|mut v| v.request("SHOW\n")) {
        let msg = match e {
            VnetdError::Unreachable(m) => m,
            VnetdError::Refused(m) => format!("vnetd on {} refused SHOW: {m}", conf.socket.display()),
        };
        return Err(CniError::new(code::NOT_AVAILABLE, msg));
    }
    let ipam = Ipam::of(conf).map_err(|e| CniError::new(code::NOT_AVAILABLE, e.msg))?;
    if let Some(ipam) = ipam {
        ipam.status()?;
    }
    Ok(())
}

/// GC: every recorded attachment of this CNI network that is not in
/// `cni.dev/valid-attachments` (absent: none is valid, as libcni and the
/// reference plugins read it) is removed as DEL would, then GC goes on to
/// the IPAM plugin. Errors do not stop it; they are reported together.
fn gc(conf: &NetConf) -> CniResult<()> {
    let valid: HashSet<(String, String)> = conf.valid_attachments.iter().flatten().cloned().collect();
    let store = Store::new(&conf.state_dir);
    let _lock = store.lock()?;
    let mut errors = Vec::new();
    for (path, record) in store.list(Some(&conf.name)) {
        let r = match record {
            Ok(r) => r,
            Err(e) => {
                eprintln!("vnet-cni: GC leaves {} alone: {e}", path.display());
                continue;
            }
        };
        if valid.contains(&(r.container_id.clone(), r.ifname.clone())) {
            continue;
        }
        eprintln!("vnet-cni: GC: removing stale attachment {}/{} (interface {})", r.container_id, r.ifname, r.interface);
        let (id, ifname, sandbox) = (r.container_id.clone(), r.ifname.clone(), r.netns.clone());
        let env = ipam::Attachment { container_id: &id, ifname: &ifname, netns: Some(&sandbox) };
        if let Err(e) = remove(conf, &store, &id, &ifname, Some(r), Some(env)) {
            errors.push(e);
        }
    }
    match Ipam::of(conf) {
        Ok(Some(ipam)) => errors.extend(ipam.gc().err()),
        Ok(None) => {}
        Err(e) => errors.push(e),
    }
    combine(errors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::IpConfig;

    fn conf(extra: &str) -> NetConf {
        NetConf::parse(format!(r#"{{"cniVersion":"1.0.0","name":"vnet-blue","type":"vnet-cni"{extra}}}"#).as_bytes()).unwrap()
    }

    #[test]
    fn the_vnetd_request_is_in_vnetds_grammar() {
        let mac: Mac = "02:12:34:56:78:9a".parse().unwrap();
        let lines = vnetd_commands("c0123456789ab", mac, &conf(r#","network":"blue""#), "cni-42", "eth0");
        assert_eq!(
            lines,
            vec![
                "INTERFACE ADD c0123456789ab 02:12:34:56:78:9a mtu 1458 netns cni-42 veth ifname eth0 network blue",
                "ROUTE ADD any 02:12:34:56:78:9a interface 02:12:34:56:78:9a any owner cni",
                "ROUTE ADD any ff:ff:ff:ff:ff:ff interface 02:12:34:56:78:9a any owner cni",
            ]
        );
        for l in &lines {
            let cmd = vnet_core::command::parse_line(l).unwrap().unwrap();
            assert!(cmd.mutates(), "{l}");
        }
        let agent = vnetd_commands("c0123456789ab", mac, &conf(r#","routes":"agent""#), "cni-42", "eth0");
        assert_eq!(agent.len(), 1, "vnet-agent routes it");
        assert!(agent[0].ends_with("network vnet-blue"));
    }

    #[test]
    fn ipv6_addresses_get_their_solicited_node_group_delivered() {
        let mac: Mac = "02:00:00:00:00:01".parse().unwrap();
        let ip = |a: &str| IpConfig { address: a.parse().unwrap(), gateway: None, interface: None };
        let r = AddResult { ips: vec![ip("10.0.0.2/24"), ip("fd00::12:3456/64"), ip("fd01::12:3456/64")], ..AddResult::default() };
        let lines = neighbour_routes(mac, &r);
        assert_eq!(lines, vec!["ROUTE ADD any 33:33:ff:12:34:56 interface 02:00:00:00:00:01 any owner cni"]);
        assert!(vnet_core::command::parse_line(&lines[0]).unwrap().is_some());
        assert!(neighbour_routes(mac, &AddResult::default()).is_empty());
    }

    #[test]
    fn a_mac_another_guest_holds_is_refused() {
        use crate::vnetd::Iface;
        let mac: Mac = "02:00:00:00:00:0b".parse().unwrap();
        let other = Iface { name: "g11".into(), mac: "02:00:00:00:00:0b".into(), ..Iface::default() };
        let e = check_mac_free(&conf(""), "c0123456789ab", mac, &[other.clone()]).unwrap_err();
        assert_eq!(e.code, code::MAC_IN_USE);
        assert!(e.msg.contains("interface g11"), "{}", e.msg);
        let list = std::env::temp_dir().join(format!("vnet-cni-macs-{}", std::process::id()));
        std::fs::write(&list, "02:00:00:00:00:0a h1 a\n02:00:00:00:00:0b h2 a\n").unwrap();
        let c = conf(&format!(r#","macsFile":"{}""#, list.display()));
        let e = check_mac_free(&c, "c0123456789ab", mac, &[]).unwrap_err();
        assert_eq!(e.code, code::MAC_IN_USE);
        assert!(e.msg.contains("host h2 in network a"), "{}", e.msg);
        let free: Mac = "02:00:00:00:00:0c".parse().unwrap();
        assert!(check_mac_free(&c, "c0123456789ab", free, &[other]).is_ok());
        std::fs::remove_file(&list).unwrap();
        let e = check_mac_free(&c, "c0123456789ab", free, &[]).unwrap_err();
        assert_eq!(e.code, code::TRY_AGAIN_LATER, "a list configured but missing");
    }

    #[test]
    fn mac_precedence() {
        let env = CniEnv { container_id: "abc".into(), ifname: "eth0".into(), args: vec![("MAC".into(), "02:00:00:00:00:0b".into())], ..CniEnv::default() };
        let c = conf(r#","runtimeConfig":{"mac":"02:00:00:00:00:0a"}"#);
        assert_eq!(choose_mac(&c, &env).unwrap().to_string(), "02:00:00:00:00:0a", "the capability first");
        assert_eq!(choose_mac(&conf(""), &env).unwrap().to_string(), "02:00:00:00:00:0b", "then CNI_ARGS");
        let plain = CniEnv { args: vec![], ..env.clone() };
        assert_eq!(choose_mac(&conf(""), &plain).unwrap(), names::derived_mac("abc", "eth0"));
        let bad = CniEnv { args: vec![("MAC".into(), "ff:ff:ff:ff:ff:ff".into())], ..env };
        assert_eq!(choose_mac(&conf(""), &bad).unwrap_err().code, code::INVALID_ENV);
    }

    #[test]
    fn results_put_the_ipam_addresses_on_the_container_interface() {
        let ipam = AddResult {
            ips: vec![IpConfig { address: "10.88.5.2/24".parse().unwrap(), gateway: None, interface: None }],
            ..AddResult::default()
        };
        let mac: Mac = "02:00:00:00:00:01".parse().unwrap();
        let ours = container_result(&conf(r#","dns":{"nameservers":["10.0.0.53"]}"#), "eth0", mac, "/run/netns/x", ipam);
        let j = ours.to_json("0.4.0");
        assert_eq!(j["interfaces"][0]["name"], "eth0");
        assert_eq!(j["interfaces"][0]["mac"], "02:00:00:00:00:01");
        assert_eq!(j["interfaces"][0]["sandbox"], "/run/netns/x");
        assert_eq!(j["ips"][0]["interface"], 0);
        assert_eq!(j["ips"][0]["version"], "4");
        assert_eq!(j["dns"]["nameservers"][0], "10.0.0.53");

        // After a plugin that made two interfaces, ours is the third.
        let prev = AddResult {
            interfaces: vec![Interface { name: "a".into(), ..Interface::default() }, Interface { name: "b".into(), ..Interface::default() }],
            ..AddResult::default()
        };
        let merged = merge(Some(prev), ours.clone());
        assert_eq!(merged.interfaces.len(), 3);
        assert_eq!(merged.ips[0].interface, Some(2));
        assert_eq!(merge(None, ours.clone()), ours);
    }

    #[test]
    fn errors_combine_under_the_first_code() {
        assert!(combine(vec![]).is_ok());
        let e = combine(vec![CniError::new(100, "a"), CniError::new(101, "b")]).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (100, "a; b"));
    }

    #[test]
    fn version_answers_in_the_version_asked() {
        let v = version_result(br#"{"cniVersion":"0.4.0"}"#);
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["supportedVersions"], json!(["0.3.1", "0.4.0", "1.0.0", "1.1.0"]));
        assert_eq!(version_result(b"")["cniVersion"], "1.1.0");
    }
}
