//! Descriptors that outlive a vnetd: a TAP's file (its queue, its carrier)
//! and the link sockets (their port, their queued datagrams), by name
//! (`tap <device>`, `udp <address> <i>/<n>`).
//!
//! While vnetd holds one, it is *offered* (`offer`): listed for a successor
//! that takes vnetd over at an upgrade (`handover`), and, under systemd,
//! put in the unit's descriptor store (`FDSTORE=1`, `FDNAME=<name>`),
//! which gives it back to the next vnetd after a restart or a crash
//! (`LISTEN_FDS`). A starting vnetd is *given* what its predecessor or
//! systemd kept (`give`), and whatever opens a TAP or binds a socket
//! *takes* the one of its name (`take`) instead of opening a new one: the
//! device never loses its reader's file, so frames wait in its queue
//! rather than being dropped, and the socket never leaves its port.
//! What nobody takes by the end of the start is closed and said (`rest`).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Offered: name -> the holder's descriptor (valid while its `Offer` lives).
static OFFERED: Mutex<BTreeMap<String, RawFd>> = Mutex::new(BTreeMap::new());
/// Given to this vnetd, not yet taken.
static GIVEN: Mutex<Option<HashMap<String, OwnedFd>>> = Mutex::new(None);
/// Objects whose state is written out only when a successor takes over
/// (a vhost-user device: its rings, memory and connection), by name.
static EXPORTS: Mutex<BTreeMap<String, Export>> = Mutex::new(BTreeMap::new());
/// States given to this vnetd, not yet taken.
static STATES: Mutex<Option<HashMap<String, String>>> = Mutex::new(None);

/// What an object hands over: a line of state and its descriptors by name.
pub struct Exported {
    pub state: String,
    pub fds: Vec<(String, OwnedFd)>,
}

/// Writes an object's state out for a successor (called once, at the
/// hand-over, with every dispatcher stopped); None: not handed over.
pub type Export = std::sync::Arc<dyn Fn() -> Option<Exported> + Send + Sync>;

/// Whether a service manager listens (NOTIFY_SOCKET), looked up once: it is
/// asked after every vhost-user message.
fn under_systemd() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| std::env::var_os("NOTIFY_SOCKET").is_some())
}

/// A descriptor (or an export) offered under a name, while its holder
/// lives.
pub struct Offer {
    name: String,
}

/// Offers an object's state, written out by `export` at a hand-over, as
/// `name` (its descriptors then named `<name> <their names>`).
pub fn offer_export(name: String, export: Export) -> Offer {
    lock(&EXPORTS).insert(name.clone(), export);
    Offer { name }
}

/// Every offered object's state, written out now (a hand-over).
pub fn exported() -> Vec<(String, Exported)> {
    let all: Vec<(String, Export)> = lock(&EXPORTS).iter().map(|(n, e)| (n.clone(), e.clone())).collect();
    all.into_iter().filter_map(|(n, e)| e().map(|x| (n, x))).collect()
}

/// A state this vnetd was given.
pub fn give_state(name: String, state: String) {
    lock(&STATES).get_or_insert_with(HashMap::new).insert(name, state);
}

/// The state given as `name`, if any, and the descriptors given with it
/// (`<name> <fd name>`), by their own names.
pub fn take_state(name: &str) -> Option<(String, HashMap<String, OwnedFd>)> {
    let state = lock(&STATES).as_mut()?.remove(name)?;
    let prefix = format!("{name} ");
    let fds = take_all(&prefix).into_iter().map(|(n, fd)| (n[prefix.len()..].to_string(), fd)).collect();
    Some((state, fds))
}

/// Offers `fd` (which the caller holds for as long as the `Offer`) as
/// `name`.
pub fn offer(name: String, fd: BorrowedFd) -> Offer {
    store(&name, fd);
    lock(&OFFERED).insert(name.clone(), fd.as_raw_fd());
    Offer { name }
}

/// Under systemd: puts `fd` in the unit's descriptor store as `name`.
pub fn store(name: &str, fd: BorrowedFd) {
    if under_systemd() {
        let state = [sd_notify::NotifyState::FdStore, sd_notify::NotifyState::FdName(name)];
        if let Err(e) = sd_notify::notify_with_fds(&state, &[fd]) {
            tracing::warn!("cannot keep {name} in systemd's descriptor store: {e}");
        }
    }
}

/// Under systemd: `text` in the descriptor store as `<name> state` (a
/// memfd holding it), the state of the object `name` for the next
/// vnetd (`from_systemd` gives it as a state).
pub fn store_text(name: &str, text: &str) {
    if !under_systemd() {
        return;
    }
    let Ok(fd) = nix::sys::memfd::memfd_create(c"vnetd-state", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC) else { return };
    if nix::unistd::write(&fd, text.as_bytes()).is_ok() {
        unstore(&format!("{name} state"));
        store(&format!("{name} state"), fd.as_fd());
    }
}

/// Under systemd: what the store holds as `name` goes.
pub fn unstore(name: &str) {
    if under_systemd() {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::FdStoreRemove, sd_notify::NotifyState::FdName(name)]);
    }
}

pub fn systemd() -> bool {
    under_systemd()
}

impl Offer {
    /// The object goes for good (its interface deleted): systemd forgets
    /// the descriptor too. Without this, dropping an offer (vnetd stopping)
    /// leaves it in systemd's store for the next vnetd.
    pub fn withdraw(&self) {
        if under_systemd() {
            let _ = sd_notify::notify(&[sd_notify::NotifyState::FdStoreRemove, sd_notify::NotifyState::FdName(&self.name)]);
        }
    }
}

impl Drop for Offer {
    fn drop(&mut self) {
        lock(&OFFERED).remove(&self.name);
        lock(&EXPORTS).remove(&self.name);
    }
}

/// What is offered now: (name, descriptor). The descriptors stay the
/// holders'; valid while nothing is torn down (the hand-over sends them
/// once the dispatchers stopped, before the topology goes).
pub fn offered() -> Vec<(String, RawFd)> {
    lock(&OFFERED).iter().map(|(n, fd)| (n.clone(), *fd)).collect()
}

/// Descriptors this vnetd was given, by name.
pub fn give(fds: impl IntoIterator<Item = (String, OwnedFd)>) {
    lock(&GIVEN).get_or_insert_with(HashMap::new).extend(fds);
}

/// Systemd's descriptor store, as it hands it to a starting vnetd
/// (`LISTEN_FDS`, `LISTEN_FDNAMES`): given. Returns how many.
pub fn from_systemd() -> usize {
    let Ok(fds) = sd_notify::listen_fds_with_names() else { return 0 };
    let mut plain = Vec::new();
    for (fd, name) in fds {
        // SAFETY: systemd passed this descriptor to this process for it to own.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // An object's state (`store_text`): its text, given as a state.
        if let Some(object) = name.strip_suffix(" state") {
            let mut text = String::new();
            let mut file = std::fs::File::from(fd);
            use std::io::{Read, Seek};
            if file.seek(std::io::SeekFrom::Start(0)).is_ok() && file.read_to_string(&mut text).is_ok() {
                give_state(object.to_string(), text);
            }
            continue;
        }
        plain.push((name, fd));
    }
    let fds = plain;
    let n = fds.len();
    give(fds);
    n
}

/// The descriptor given as `name`, if any: the caller's from now on.
pub fn take(name: &str) -> Option<OwnedFd> {
    lock(&GIVEN).as_mut()?.remove(name)
}

/// Every given descriptor whose name starts with `prefix`: the caller's.
pub fn take_all(prefix: &str) -> Vec<(String, OwnedFd)> {
    let mut g = lock(&GIVEN);
    let Some(m) = g.as_mut() else { return Vec::new() };
    let names: Vec<String> = m.keys().filter(|n| n.starts_with(prefix)).cloned().collect();
    names.into_iter().filter_map(|n| m.remove(&n).map(|fd| (n, fd))).collect()
}

/// What was given and nobody took (closed now): their names.
pub fn rest() -> Vec<String> {
    let mut names: Vec<String> = lock(&GIVEN).take().map(|m| m.into_keys().collect()).unwrap_or_default();
    names.extend(lock(&STATES).take().map(|m| m.into_keys().map(|n| format!("{n} (state)")).collect::<Vec<_>>()).unwrap_or_default());
    names.sort();
    names
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
