//! A vhost-user virtio-net NIC: the VMM (QEMU, cloud-hypervisor) or a
//! userspace driver (DPDK's virtio-user) shares the guest's memory and rings
//! with vnetd over a Unix socket, and vnetd's dispatchers move frames
//! straight between the guest's buffers and the overlay — the virtio NIC
//! VNET/P put in the VMM, with no TAP and no host kernel between.
//!
//! The device itself (rings, guest memory, notifications, the protocol's
//! messages, every defence against a hostile frontend) is the `vnet-vhost`
//! crate; this is where it meets vnetd: the socket, a thread per NIC that
//! serves it (`server`) or keeps connecting to the VMM's (`client`) and
//! starts over whenever either side restarts, and the `VirtualNic` the
//! dispatchers use.
//!
//! Sockets live in one directory (`--vhost-user-dir`, /run/vnet by
//! default), named plainly; vnetd never follows a link there, never
//! replaces anything but a stale socket, and makes its own mode 600 through
//! a descriptor of the file it bound.

mod vsock;

use super::{Received, RxBuffers, RxFrame, VirtualNic};
use crate::settings::IrqPolicy;
use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vnet_core::offload::VnetHdr;
use crate::stats::Changes;
use crate::sys::eventfd::EventFd;
use crate::sys::keep;
use vnet_vhost::{Device, DirtyPages, Frontend, MemoryPolicy, Taken};

/// The device, its guest memory logging writes while a VMM migrates the VM.
type Dev = Device<DirtyPages>;

/// How the socket's other end is met.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// vnetd listens; the VMM connects (QEMU's `reconnect=1` comes back
    /// after a vnetd restart).
    Server,
    /// The VMM listens (`server=on`); vnetd connects, and again whenever
    /// the connection drops.
    Client,
}

/// The protocol thread's stop signal and what to shut down to wake it.
struct Control {
    stop: AtomicBool,
    /// The live connection (shut down to end it) and the listener.
    conn: Mutex<Option<UnixStream>>,
    listener: Option<RawFd>,
    /// The guest works the rings (`Device::running`, as last reported to
    /// `changes`).
    running: AtomicBool,
    changes: Arc<Changes>,
    /// Reports left in the current burst, and when the last one was made.
    budget: Mutex<(u32, Instant)>,
    /// A report held back (over the budget) waits for the gap's end.
    deferred: AtomicBool,
    /// A hand-over (`handover`): the protocol thread is asked to stop
    /// reading the connection (`park`) and says it has (`parked`); once
    /// the state is written out (`handed`), the connection is the next
    /// vnetd's: never shut down here.
    park: EventFd,
    parked: AtomicBool,
    handed: AtomicBool,
    /// The connection's frontend, while one is connected.
    frontend: Mutex<Option<Arc<Mutex<Frontend<DirtyPages>>>>>,
    /// `vhost <name>`: what the device is kept as (`keep`), and under
    /// systemd what its descriptor store holds of it now (the state's text
    /// and the names stored).
    key: String,
    stored: Mutex<Option<(String, Vec<String>)>>,
}

/// Under systemd: the device as it is set up now in the unit's descriptor
/// store (its connection, memory files, ring eventfds and state, the next
/// indexes left to be read back from guest memory), so that a vnetd
/// started after a crash serves the same connection on and QEMU never sees
/// the backend go. Stored again only when the frontend changed the setup.
fn store(control: &Control, fe: &Mutex<Frontend<DirtyPages>>) {
    if !keep::systemd() {
        return;
    }
    let Some(x) = fe.lock().unwrap().export(false) else {
        unstore(control);
        return;
    };
    let mut last = control.stored.lock().unwrap();
    if last.as_ref().is_some_and(|(t, _)| *t == x.text) {
        return;
    }
    match last.take() {
        Some((_, names)) => names.iter().for_each(|n| keep::unstore(n)),
        // What a vnetd before this one stored of it.
        None => {
            let queues = (0..2 * vnet_vhost::MAX_PAIRS).flat_map(|i| [format!("kick {i}"), format!("call {i}")]);
            let mems = (0..8).map(|i| format!("mem {i}"));
            ["conn".to_string(), "state".to_string(), "taken".to_string()].into_iter().chain(queues).chain(mems).for_each(|n| keep::unstore(&format!("{} {n}", control.key)))
        }
    }
    let mut names = Vec::new();
    for (n, fd) in &x.fds {
        let full = format!("{} {n}", control.key);
        keep::store(&full, std::os::fd::AsFd::as_fd(fd));
        names.push(full);
    }
    if let Some(c) = control.conn.lock().unwrap().as_ref() {
        let full = format!("{} conn", control.key);
        keep::store(&full, std::os::fd::AsFd::as_fd(c));
        names.push(full);
    }
    keep::store_text(&control.key, &x.text);
    names.push(format!("{} state", control.key));
    *last = Some((x.text, names));
}

/// Under systemd: the device's entries in the descriptor store go (its
/// connection ended, or was shut down).
fn unstore(control: &Control) {
    if let Some((_, names)) = control.stored.lock().unwrap().take() {
        names.iter().for_each(|n| keep::unstore(n));
    }
}

/// Ring starts and stops reported per device: a burst of this many, then
/// one each `REPORT_GAP`; a frontend that starts and stops its rings faster
/// is reported at that pace, its last state when the gap ends (each report
/// wakes vnet-agent's `WAIT`, which then reads vnetd and may write etcd: the
/// security review's L3).
const REPORT_BURST: u32 = 4;
const REPORT_GAP: Duration = Duration::from_millis(100);

impl Control {
    /// Reports the device's running state if it changed, within the budget;
    /// over it, once the gap ends.
    fn report(self: &Arc<Self>, shared: &Arc<Dev>) {
        let now = shared.running();
        if self.running.load(Relaxed) == now {
            return;
        }
        {
            let mut b = self.budget.lock().unwrap_or_else(|p| p.into_inner());
            let t = Instant::now();
            let refill = (t.duration_since(b.1).as_millis() / REPORT_GAP.as_millis()) as u32;
            b.0 = (b.0 + refill).min(REPORT_BURST);
            if refill > 0 {
                b.1 = t;
            }
            if b.0 == 0 {
                drop(b);
                if !self.deferred.swap(true, Relaxed) {
                    let (c, s) = (self.clone(), shared.clone());
                    let _ = std::thread::Builder::new().name("vhost-report".into()).spawn(move || {
                        std::thread::sleep(REPORT_GAP);
                        c.deferred.store(false, Relaxed);
                        c.report(&s);
                    });
                }
                return;
            }
            b.0 -= 1;
        }
        self.running.store(now, Relaxed);
        tracing::info!("vhost-user guest {}", if now { "running: its rings started" } else { "stopped: its rings stopped" });
        self.changes.bump();
    }
}

pub struct VhostUserNic {
    shared: Arc<Dev>,
    control: Arc<Control>,
    path: PathBuf,
    role: Role,
    /// The socket file this NIC made (device and inode), removed when the
    /// NIC goes if it is still the same file.
    made: Option<(Arc<SocketDir>, String, (u64, u64))>,
    _listener: Option<UnixListener>,
    /// The device's state, for a successor that takes vnetd over.
    _offer: keep::Offer,
    /// The VM's vsock device, if it has one (`vsock <cid>`).
    vsock: Option<vsock::VsockChannel>,
}

/// Where a NIC's socket is: `--vhost-user-dir` and a plain name in it.
pub struct Where<'a> {
    pub dir: &'a Path,
    /// A plain name, or an absolute path whose directory is `dir`.
    pub socket: &'a str,
}

impl VhostUserNic {
    /// Serves a vhost-user-net device on its socket (`client`: connects to
    /// the VMM's socket there instead); `unsealed`: takes guest memory files
    /// that are not sealed against shrinking.
    /// The NIC reports its guest starting and stopping to `changes`.
    pub fn new(name: &str, at: &Where, client: bool, unsealed: bool, vsock: Option<u32>, changes: Arc<Changes>) -> Result<VhostUserNic> {
        let (dir, file) = resolve(at)?;
        let dir = Arc::new(SocketDir::open(&dir)?);
        let path = dir.path.join(&file);
        let vsock = vsock.map(|cid| vsock::VsockChannel::new(name, dir.clone(), &file, cid, unsealed)).transpose()?;
        let shared = Arc::new(Device::new(MemoryPolicy { allow_unsealed: unsealed }).context("vhost-user device")?);
        let (role, listener, made) = if client {
            (Role::Client, None, None)
        } else {
            let (l, id) = dir.bind(&file)?;
            (Role::Server, Some(l), Some((dir.clone(), file.clone(), id)))
        };
        let control = Arc::new(Control {
            stop: AtomicBool::new(false),
            conn: Mutex::new(None),
            listener: listener.as_ref().map(|l| l.as_raw_fd()),
            running: AtomicBool::new(false),
            changes,
            budget: Mutex::new((REPORT_BURST, Instant::now())),
            deferred: AtomicBool::new(false),
            park: EventFd::new().context("eventfd")?,
            parked: AtomicBool::new(false),
            handed: AtomicBool::new(false),
            frontend: Mutex::new(None),
            key: format!("vhost {name}"),
            stored: Mutex::new(None),
        });
        // The previous vnetd's connection and device, if it handed them
        // over: served from where it stopped, the frontend none the wiser.
        let key = format!("vhost {name}");
        let adopted = keep::take_state(&key).and_then(|(state, mut fds)| {
            let conn = fds.remove("conn")?;
            match Frontend::import(shared.clone(), &state, fds) {
                Ok((fe, acked, protocol)) => Some((UnixStream::from(conn), fe, acked, protocol)),
                Err(e) => {
                    tracing::warn!("vhost-user {name}: the previous vnetd's device not taken ({e}); its frontend reconnects");
                    None
                }
            }
        });
        let (s, c) = (shared.clone(), control.clone());
        let l = listener.as_ref().map(|l| l.try_clone()).transpose().context("listener")?;
        let d = dir.clone();
        std::thread::Builder::new()
            .name(format!("vhost-{name}"))
            .spawn(move || {
                if let Some(a) = adopted {
                    run_adopted(&s, &c, a);
                }
                match l {
                    Some(l) => serve(&s, &c, &l),
                    None => connect_loop(&s, &c, &d, &file),
                }
            })
            .context("cannot start the vhost-user thread")?;
        let (s, c) = (shared.clone(), control.clone());
        let offer = keep::offer_export(key, Arc::new(move || export(&s, &c)));
        Ok(VhostUserNic { shared, control, path, role, made, _listener: listener, _offer: offer, vsock })
    }
}

/// The device's state for a successor (a hand-over): the protocol thread
/// stops reading the connection first, so nothing the frontend sends from
/// now on is read by this vnetd.
fn export(shared: &Arc<Dev>, control: &Arc<Control>) -> Option<keep::Exported> {
    if !shared.connected.load(Relaxed) {
        return None;
    }
    let _ = control.park.notify();
    let t0 = Instant::now();
    while !control.parked.load(Relaxed) {
        if t0.elapsed() > Duration::from_secs(1) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let fe = control.frontend.lock().unwrap().clone()?;
    let x = fe.lock().unwrap().export(true)?;
    let conn = control.conn.lock().unwrap().as_ref()?.try_clone().ok()?;
    let mut fds = x.fds;
    fds.push(("conn".into(), OwnedFd::from(conn)));
    control.handed.store(true, Relaxed);
    Some(keep::Exported { state: x.text, fds })
}

/// Serves a connection the previous vnetd handed over, its device already
/// set up (`Frontend::import`). The `vhost` crate's handler keeps what was
/// negotiated (features, protocol features: replies and acks depend on
/// them) where nothing can set it but the messages themselves: so it is
/// made on a socket pair, told them there as the frontend told them, and
/// then its socket is made the frontend's connection (dup2 onto its
/// descriptor), from which it reads on.
fn run_adopted(shared: &Arc<Dev>, control: &Arc<Control>, (conn, fe, acked, protocol): (UnixStream, Frontend<DirtyPages>, u64, u64)) {
    let fe = Arc::new(Mutex::new(fe));
    let handler = (|| -> io::Result<BackendReqHandler<Mutex<Frontend<DirtyPages>>>> {
        let (a, mut b) = UnixStream::pair()?;
        let a_fd = a.as_raw_fd();
        let mut handler = BackendReqHandler::from_stream(a, fe.clone());
        let msg = |code: u32, value: Option<u64>| -> Vec<u8> {
            let mut m = Vec::with_capacity(20);
            m.extend_from_slice(&code.to_le_bytes());
            m.extend_from_slice(&1u32.to_le_bytes()); // version 1
            m.extend_from_slice(&(if value.is_some() { 8u32 } else { 0 }).to_le_bytes());
            if let Some(v) = value {
                m.extend_from_slice(&v.to_le_bytes());
            }
            m
        };
        // GET_FEATURES, SET_FEATURES, GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES.
        use std::io::Write;
        for m in [msg(1, None), msg(2, Some(acked)), msg(15, None), msg(16, Some(protocol))] {
            b.write_all(&m)?;
        }
        for _ in 0..4 {
            handler.handle_request().map_err(|e| io::Error::other(format!("{e}")))?;
        }
        // SAFETY: dup2 onto the descriptor the handler reads, which this
        // function made and nothing else uses: it now reads the frontend.
        if unsafe { libc::dup2(conn.as_raw_fd(), a_fd) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(handler)
    })();
    match handler {
        Ok(h) => {
            tracing::info!("vhost-user frontend taken over from the previous vnetd: connected, rings as they were");
            serve_handler(shared, control, conn, h, fe);
        }
        Err(e) => tracing::warn!("vhost-user: cannot take the previous vnetd's connection over ({e}); its frontend reconnects"),
    }
}

/// The directory and plain name a socket argument means.
fn resolve(at: &Where) -> Result<(PathBuf, String)> {
    let dir = at.dir;
    let (parent, name) = match at.socket.rsplit_once('/') {
        None => (dir.to_path_buf(), at.socket.to_string()),
        Some((p, n)) => (PathBuf::from(if p.is_empty() { "/" } else { p }), n.to_string()),
    };
    if parent != dir || !vnet_core::command::is_plain_socket_name(&name) {
        bail!("vhost-user sockets live in {} (--vhost-user-dir): give a plain name there (letters, digits, '.', '_', '-'), not {}", dir.display(), at.socket);
    }
    Ok((parent, name))
}

/// The directory vhost-user sockets live in, held open: every name is
/// looked up in it, never through a link.
pub(crate) struct SocketDir {
    fd: OwnedFd,
    path: PathBuf,
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).context("a name with a NUL byte")
}

impl SocketDir {
    /// Opens (making it, 0755, if missing) the directory; one others may
    /// write into, or owned by another user than vnetd's or root, is refused.
    pub(super) fn open(dir: &Path) -> Result<SocketDir> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot make {}", dir.display()))?;
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        }
        let c = CString::new(dir.as_os_str().as_encoded_bytes()).context("a path with a NUL byte")?;
        // SAFETY: open(2) of a NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("cannot open {} (a directory, not a link)", dir.display()));
        }
        // SAFETY: a descriptor we just opened.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = fstat(fd.as_raw_fd())?;
        if st.st_mode & 0o022 != 0 {
            bail!("{} may be written by others (mode {:o}): vhost-user sockets need a directory only vnetd's user writes", dir.display(), st.st_mode & 0o7777);
        }
        // Its owner may write it whatever the mode says (and swap a socket
        // for a link between a check and a connect): vnetd's user or root
        // only (the security review's L4).
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me && st.st_uid != 0 {
            bail!("{} belongs to uid {}: vhost-user sockets need a directory of vnetd's user (uid {me}) or root", dir.display(), st.st_uid);
        }
        Ok(SocketDir { fd, path: dir.to_path_buf() })
    }

    /// `name` inside the directory, reached through its descriptor (a
    /// socket address: at most 107 bytes, which this is).
    fn via_fd(&self, name: &str) -> String {
        format!("/proc/self/fd/{}/{name}", self.fd.as_raw_fd())
    }

    /// What is at `name` (not following a link), if anything.
    fn stat(&self, name: &str) -> Result<Option<libc::stat>> {
        let n = cstr(name)?;
        // SAFETY: fstatat into a zeroed stat; the result is checked.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatat(self.fd.as_raw_fd(), n.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::NotFound { Ok(None) } else { Err(e).context(name.to_string()) };
        }
        Ok(Some(st))
    }

    /// Binds the server socket `name`: something already there is replaced
    /// only if it is a socket nobody listens on (left by a vnetd that
    /// died); never a link, never another file. Mode 600, set through a
    /// descriptor of the very file bound. (device, inode) of the socket.
    pub(super) fn bind(&self, name: &str) -> Result<(UnixListener, (u64, u64))> {
        let shown = self.path.join(name);
        if let Some(st) = self.stat(name)? {
            if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                bail!("{} exists and is not a socket (a link or a file): not replaced", shown.display());
            }
            if UnixStream::connect(self.via_fd(name)).is_ok() {
                bail!("{} is a socket something listens on: not replaced", shown.display());
            }
            let n = cstr(name)?;
            // SAFETY: unlinkat of a name in our directory.
            if unsafe { libc::unlinkat(self.fd.as_raw_fd(), n.as_ptr(), 0) } < 0 {
                return Err(io::Error::last_os_error()).with_context(|| format!("cannot replace stale socket {}", shown.display()));
            }
        }
        let l = UnixListener::bind(self.via_fd(name)).with_context(|| format!("cannot listen on {}", shown.display()))?;
        // Whoever connects gets to map memory into vnetd and feed it
        // descriptors: vnetd's own user only, unless the admin opens it (or
        // uses `client`). The file bound is opened without following links
        // and changed through that descriptor.
        let n = cstr(name)?;
        // SAFETY: openat(2) with O_PATH; the result is checked.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), n.as_ptr(), libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("cannot open {}", shown.display()));
        }
        // SAFETY: a descriptor we just opened.
        let file = unsafe { OwnedFd::from_raw_fd(fd) };
        let st = fstat(file.as_raw_fd())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
            bail!("{} changed under vnetd while it was bound", shown.display());
        }
        let through = cstr(&format!("/proc/self/fd/{}", file.as_raw_fd()))?;
        // SAFETY: chmod(2) of the descriptor's own file (a socket, checked).
        if unsafe { libc::chmod(through.as_ptr(), 0o600) } < 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("cannot restrict {}", shown.display()));
        }
        Ok((l, (st.st_dev, st.st_ino)))
    }

    /// Connects to the VMM's socket `name` (a socket, not a link).
    pub(super) fn connect(&self, name: &str) -> Result<UnixStream> {
        match self.stat(name)? {
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFSOCK => {}
            Some(_) => bail!("{} is not a socket (a link or a file): not connected to", self.path.join(name).display()),
            None => bail!("{} does not exist yet", self.path.join(name).display()),
        }
        Ok(UnixStream::connect(self.via_fd(name))?)
    }

    /// `connect`, without waiting: a listener whose backlog is full
    /// refuses at once (`EAGAIN`) rather than holding the caller until
    /// its program accepts. The socket returned is non-blocking.
    pub(super) fn connect_now(&self, name: &str) -> Result<OwnedFd> {
        match self.stat(name)? {
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFSOCK => {}
            Some(_) => bail!("{} is not a socket (a link or a file): not connected to", self.path.join(name).display()),
            None => bail!("{} does not exist", self.path.join(name).display()),
        }
        let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM.nonblocking().cloexec(), None)?;
        let to = socket2::SockAddr::unix(self.via_fd(name))?;
        match s.connect(&to) {
            Ok(()) => Ok(s.into()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => bail!("{}: its backlog is full (nobody accepts)", self.path.join(name).display()),
            Err(e) => Err(e).with_context(|| format!("cannot connect to {}", self.path.join(name).display())),
        }
    }

    /// Removes `name` if it is still the socket (device, inode) made.
    pub(super) fn remove_if(&self, name: &str, id: (u64, u64)) {
        if let Ok(Some(st)) = self.stat(name) {
            if (st.st_dev, st.st_ino) == id {
                if let Ok(n) = cstr(name) {
                    // SAFETY: unlinkat of a name in our directory.
                    unsafe { libc::unlinkat(self.fd.as_raw_fd(), n.as_ptr(), 0) };
                }
            }
        }
    }
}

fn fstat(fd: RawFd) -> Result<libc::stat> {
    // SAFETY: fstat into a zeroed stat; the result is checked.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return Err(io::Error::last_os_error().into());
    }
    Ok(st)
}

/// Serves one frontend connection until it ends (or vnetd stops it).
fn run_connection(shared: &Arc<Dev>, control: &Arc<Control>, stream: UnixStream) {
    let Ok(conn) = stream.try_clone() else { return };
    let fe = Arc::new(Mutex::new(Frontend::new(shared.clone())));
    let handler = BackendReqHandler::from_stream(stream, fe.clone());
    shared.counters.connects.fetch_add(1, Relaxed);
    tracing::info!("vhost-user frontend connected");
    serve_handler(shared, control, conn, handler, fe);
}

/// Serves the frontend on `conn` with `handler` until it goes (or vnetd
/// stops it, or hands it over: then it stops reading and stays parked).
fn serve_handler(shared: &Arc<Dev>, control: &Arc<Control>, conn: UnixStream, mut handler: BackendReqHandler<Mutex<Frontend<DirtyPages>>>, fe: Arc<Mutex<Frontend<DirtyPages>>>) {
    let conn_fd = conn.as_raw_fd();
    *control.conn.lock().unwrap() = Some(conn);
    if control.stop.load(Relaxed) {
        return;
    }
    *control.frontend.lock().unwrap() = Some(fe.clone());
    shared.connected.store(true, Relaxed);
    // A device taken over runs from the start.
    control.report(shared);
    store(control, &fe);
    loop {
        // A message, or a hand-over: then this vnetd reads no more of it.
        let mut fds = [libc::pollfd { fd: conn_fd, events: libc::POLLIN, revents: 0 }, libc::pollfd { fd: control.park.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        // SAFETY: poll(2) on two descriptors this thread holds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        if fds[1].revents != 0 {
            control.parked.store(true, Relaxed);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        match handler.handle_request() {
            Ok(()) => store(control, &fe),
            // The device refused one request; the frontend was told.
            Err(e @ (VhostError::InvalidParam | VhostError::InvalidOperation(_) | VhostError::InactiveFeature(_) | VhostError::InactiveOperation(_) | VhostError::ReqHandlerError(_))) => {
                tracing::debug!("vhost-user request refused: {e}");
            }
            Err(e) => {
                if !control.stop.load(Relaxed) {
                    tracing::info!("vhost-user frontend gone: {e}");
                }
                break;
            }
        }
        control.report(shared);
    }
    shared.connected.store(false, Relaxed);
    unstore(control);
    *control.frontend.lock().unwrap() = None;
    fe.lock().unwrap().reset();
    control.report(shared);
    *control.conn.lock().unwrap() = None;
}

fn serve(shared: &Arc<Dev>, control: &Arc<Control>, listener: &UnixListener) {
    while !control.stop.load(Relaxed) {
        match listener.accept() {
            Ok((s, _)) => run_connection(shared, control, s),
            Err(e) => {
                if control.stop.load(Relaxed) {
                    return;
                }
                tracing::warn!("vhost-user accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn connect_loop(shared: &Arc<Dev>, control: &Arc<Control>, dir: &SocketDir, name: &str) {
    let mut logged = false;
    while !control.stop.load(Relaxed) {
        match dir.connect(name) {
            Ok(s) => {
                logged = false;
                run_connection(shared, control, s);
            }
            Err(e) => {
                if !logged {
                    tracing::info!(socket = name, "vhost-user: cannot connect yet ({e:#}); retrying");
                    logged = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

impl Drop for VhostUserNic {
    fn drop(&mut self) {
        self.control.stop.store(true, Relaxed);
        // A connection handed over is the next vnetd's: only closed here.
        if let Some(c) = self.control.conn.lock().unwrap().take() {
            if !self.control.handed.load(Relaxed) {
                let _ = c.shutdown(std::net::Shutdown::Both);
                unstore(&self.control);
            }
        }
        if let Some(l) = self.control.listener {
            // SAFETY: shutdown(2) on our listening socket wakes its accept.
            unsafe { libc::shutdown(l, libc::SHUT_RDWR) };
        }
        if let Some((dir, name, id)) = &self.made {
            dir.remove_if(name, *id);
        }
    }
}

impl VirtualNic for VhostUserNic {
    fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let mut got = Err(io::ErrorKind::WouldBlock.into());
        self.shared.take_burst(0, buf, None, 1, |t, _, _| {
            got = match t {
                Taken::Copied { len, vnet } => Ok(Received { start: 0, end: len, vnet }),
                Taken::TooBig => Err(io::Error::from_raw_os_error(libc::EMSGSIZE)),
                Taken::InPlace => unreachable!("in place only when asked"),
            }
        });
        // Copied out: its buffer goes back at once.
        self.shared.release(0);
        got
    }

    fn queues(&self) -> usize {
        vnet_vhost::MAX_PAIRS
    }

    fn recv_burst(&self, pair: usize, rx: &mut RxBuffers, quota: usize, each: &mut dyn FnMut(RxFrame)) -> io::Result<()> {
        self.shared.take_burst(pair, rx.buf, rx.in_place.as_deref_mut(), quota, |t, buf, frame| match t {
            Taken::Copied { len, vnet } => each(RxFrame::Copied(&mut buf[..len], vnet)),
            Taken::InPlace => each(RxFrame::InPlace(frame.expect("in place only when asked"))),
            Taken::TooBig => each(RxFrame::Oversize),
        });
        Ok(())
    }

    fn send(&self, vnet: &VnetHdr, parts: &[&[u8]]) -> io::Result<usize> {
        self.shared.send(vnet, parts)
    }

    fn send_burst(&self, vnet: &VnetHdr, frames: &mut dyn Iterator<Item = &[u8]>, done: &mut dyn FnMut(io::Result<usize>)) {
        self.shared.send_burst(vnet, frames, done);
    }

    fn event_fd(&self, pair: usize) -> RawFd {
        self.shared.event_fd(pair)
    }

    fn running(&self) -> bool {
        self.control.running.load(Relaxed)
    }

    fn set_notify(&self, pair: usize, on: bool) {
        self.shared.set_notify(pair, on);
    }

    fn arriving(&self, irq: &IrqPolicy) {
        self.shared.arriving(irq);
    }

    fn flush(&self, irq: &IrqPolicy) -> bool {
        self.shared.flush(irq)
    }

    fn idle(&self) {
        self.shared.idle();
    }

    fn release(&self, pair: usize) {
        self.shared.release(pair);
    }

    fn takes_offloads(&self) -> bool {
        self.shared.takes_offloads()
    }

    fn describe(&self) -> String {
        let role = if self.role == Role::Client { " client" } else { "" };
        let unsealed = if self.shared.memory_policy().allow_unsealed { " unsealed-memory" } else { "" };
        let up = if self.shared.connected.load(Relaxed) { "yes" } else { "no" };
        let running = if self.running() { "yes" } else { "no" };
        let broken = self.shared.broken().map(|why| format!(" broken={}", why.replace(' ', "-"))).unwrap_or_default();
        format!("vhost-user={}{role}{unsealed} connected={up} running={running}{broken}", self.path.display())
    }

    fn extra_stats(&self) -> String {
        let mut s = String::new();
        self.shared.render_stats(&mut s);
        if let Some(v) = &self.vsock {
            v.render_stats(&mut s);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_socket_directory_others_may_write_is_refused() {
        let base = std::env::temp_dir().join(format!("vnet-vhost-dir-{}", std::process::id()));
        for (mode, ok) in [(0o700, true), (0o755, true), (0o775, false), (0o777, false), (0o1777, false)] {
            let d = base.join(format!("{mode:o}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(SocketDir::open(&d).is_ok(), ok, "mode {mode:o}");
        }
        // A link to a good directory is not a directory here.
        let link = base.join("link");
        std::os::unix::fs::symlink(base.join("700"), &link).unwrap();
        assert!(SocketDir::open(&link).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn connecting_now_to_a_listener_nobody_accepts_on_is_refused_not_waited_for() {
        let base = std::env::temp_dir().join(format!("vnet-vhost-now-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o700)).unwrap();
        let dir = SocketDir::open(&base).unwrap();
        assert!(dir.connect_now("absent").is_err());
        let (l, _) = dir.bind("full").unwrap();
        // A backlog of one: once it is full, the next connect would sleep.
        // SAFETY: listen(2) on the socket just bound.
        assert_eq!(unsafe { libc::listen(l.as_raw_fd(), 1) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = std::thread::spawn(move || {
            let mut held = Vec::new();
            let refused = (0..8).find_map(|_| match dir.connect_now("full") {
                Ok(s) => {
                    held.push(s);
                    None
                }
                Err(e) => Some(format!("{e:#}")),
            });
            tx.send((held.len(), refused)).unwrap();
        });
        let (made, refused) = rx.recv_timeout(Duration::from_secs(5)).expect("a connect waited for an accept");
        d.join().unwrap();
        assert!(made >= 1, "{made}");
        assert!(refused.as_deref().is_some_and(|e| e.contains("backlog is full")), "{refused:?}");
        drop(l);
        std::fs::remove_dir_all(&base).unwrap();
    }
}

/// Interfaces attached as `vhost-user` (on a socket).
pub struct Kind;

impl super::NicKind for Kind {
    fn takes(&self, attach: &vnet_core::command::Attach) -> bool {
        matches!(attach, vnet_core::command::Attach::VhostUser { .. })
    }

    fn make(&self, spec: &super::NicSpec) -> std::result::Result<Box<dyn VirtualNic>, String> {
        let vnet_core::command::Attach::VhostUser { client, unsealed, vsock } = spec.attach else { return Err("not a vhost-user interface".into()) };
        let socket = spec.socket.ok_or("a vhost-user interface needs a socket")?;
        let at = Where { dir: spec.vhost_dir, socket };
        VhostUserNic::new(spec.name, &at, client, unsealed, vsock, spec.changes.clone()).map(|n| Box::new(n) as Box<dyn VirtualNic>).map_err(|e| format!("{e:#}"))
    }
}
