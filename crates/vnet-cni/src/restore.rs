//! `vnet-cni restore`: after vnetd restarts, re-adds every recorded
//! attachment it does not hold. vnetd's veth pairs outlive it (both ends
//! stay when it exits), and `INTERFACE ADD` of the same name, MAC and
//! namespace takes the existing pair over: the container keeps its device,
//! ifindex, addresses and routes, and traffic flows again once the request
//! (with its routes) is in force. Meant for the vnetd unit:
//! `ExecStartPost=-/usr/lib/cni/vnet-cni restore`.

use crate::netns;
use crate::state::{Record, Store};
use crate::vnetd::{Iface, Vnetd, VnetdError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// What became of one record.
enum Outcome {
    Restored,
    /// vnetd already holds it.
    Held,
    /// The container's namespace is gone: nothing to restore (the runtime's
    /// DEL, or GC, will remove the record).
    Gone,
}

/// Restores the records of `state_dir` (only those made with `socket`, if
/// given), waiting up to `wait` for each vnetd to answer. Prints a line per
/// attachment; fails if any could not be restored.
pub fn run(state_dir: &Path, socket: Option<&Path>, wait: Duration) -> ExitCode {
    let store = Store::new(state_dir);
    let _lock = match store.lock() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("vnet-cni restore: {e}");
            return ExitCode::FAILURE;
        }
    };
    let wanted = socket.map(canonical);
    let mut failed = 0;
    let mut by_socket: BTreeMap<PathBuf, Vec<Record>> = BTreeMap::new();
    for (path, record) in store.list(None) {
        match record {
            Ok(r) if wanted.as_ref().is_none_or(|w| *w == canonical(&r.socket)) => by_socket.entry(r.socket.clone()).or_default().push(r),
            Ok(_) => {}
            Err(e) => {
                eprintln!("vnet-cni restore: skipping {}: {e}", path.display());
                failed += 1;
            }
        }
    }
    let (mut restored, mut held, mut gone) = (0, 0, 0);
    for (socket, records) in by_socket {
        let (mut vnetd, ifaces) = match connect(&socket, wait) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("vnet-cni restore: {e}: {} attachment(s) not restored", records.len());
                failed += records.len();
                continue;
            }
        };
        for r in records {
            let what = format!("{}/{}-{} (interface {} {})", r.cni_network, r.container_id, r.ifname, r.interface, r.mac);
            match restore_one(&mut vnetd, &ifaces, &r) {
                Ok(Outcome::Restored) => {
                    restored += 1;
                    println!("restored {what} on {}", socket.display());
                }
                Ok(Outcome::Held) => held += 1,
                Ok(Outcome::Gone) => {
                    gone += 1;
                    println!("skipped {what}: its network namespace {} is gone", r.netns_name);
                }
                Err(e) => {
                    failed += 1;
                    eprintln!("vnet-cni restore: cannot restore {what}: {e}");
                }
            }
        }
    }
    println!("vnet-cni restore: {restored} restored, {held} already in vnetd, {gone} without a namespace, {failed} failed");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A socket's path with its directory resolved (/var/run/x and /run/x are
/// one socket), even before the socket itself exists.
fn canonical(p: &Path) -> PathBuf {
    match (p.parent().and_then(|d| std::fs::canonicalize(d).ok()), p.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => p.to_path_buf(),
    }
}

/// A session with the vnetd on `socket` and its interfaces, once it
/// answers (it may still be starting when a unit's ExecStartPost runs).
fn connect(socket: &Path, wait: Duration) -> Result<(Vnetd, Vec<Iface>), String> {
    let deadline = Instant::now() + wait;
    loop {
        match Vnetd::connect(socket).and_then(|mut v| v.interfaces().map(|i| (v, i))) {
            Ok(ok) => return Ok(ok),
            Err(VnetdError::Refused(m)) => return Err(format!("vnetd on {} refused INTERFACE LIST: {m}", socket.display())),
            Err(VnetdError::Unreachable(m)) if Instant::now() >= deadline => return Err(m),
            Err(VnetdError::Unreachable(_)) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn restore_one(vnetd: &mut Vnetd, ifaces: &[Iface], r: &Record) -> Result<Outcome, String> {
    if let Some(i) = ifaces.iter().find(|i| i.name == r.interface) {
        return if i.mac == r.mac {
            Ok(Outcome::Held)
        } else {
            Err(format!("vnetd holds an interface {} with MAC {}", i.name, i.mac))
        };
    }
    if !netns::is_netns(&netns::path_of(&r.netns_name)) {
        return Ok(Outcome::Gone);
    }
    vnetd.apply(&r.commands).map_err(|e| match e {
        VnetdError::Refused(m) => format!("vnetd refused: {m}"),
        VnetdError::Unreachable(m) => m,
    })?;
    Ok(Outcome::Restored)
}
