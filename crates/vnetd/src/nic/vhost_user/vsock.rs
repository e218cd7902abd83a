//! A VM's vsock device, beside its vhost-user NIC (`INTERFACE ADD ...
//! vhost-user <socket> vsock <cid>`): vnetd serves `vhost-user-vsock` on
//! `<socket>.vsock` in the vhost-user directory (QEMU's
//! `-device vhost-user-vsock-pci`), and the guest's `AF_VSOCK` streams to its
//! host (CID 2) are carried by the `vnet_vhost::vsock` connection thread.
//!
//! Where they go on the host is the hybrid vsock convention of Firecracker
//! and cloud-hypervisor (docs/vtoe.md): the guest connecting to port P
//! reaches whoever listens on `<socket>.vsock-host_P` in the same directory;
//! a host program connecting to `<socket>.vsock-host` writes
//! `CONNECT <port>\n` and, once the guest's listener accepted, reads
//! `OK <host port>\n`, then the stream. The guest reaches only those
//! sockets, and only its own CID exists for it.

use super::SocketDir;
use anyhow::{bail, Context, Result};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vnet_vhost::vsock::{self, HostSide, Incoming, Mux, Opener};
use vnet_vhost::{Frontend, MemoryPolicy};

type Fe = Frontend<(), vsock::Device>;

/// How long a host program has to say which port it wants.
const CONNECT_LINE_WAIT: Duration = Duration::from_secs(5);

struct Shared {
    stop: AtomicBool,
    /// The frontend's connection, shut down to end it.
    conn: Mutex<Option<UnixStream>>,
    listeners: [RawFd; 2],
}

/// A running vsock device; everything stops and its sockets go with it.
pub struct VsockChannel {
    shared: Arc<Shared>,
    pub dev: Arc<vsock::Device>,
    pub counters: Arc<vsock::Counters>,
    dir: Arc<SocketDir>,
    made: Vec<(String, (u64, u64))>,
    _listeners: [UnixListener; 2],
}

/// Guest connections to host port P go to `<base>.vsock-host_P`.
struct Hybrid {
    dir: Arc<SocketDir>,
    host: String,
}

impl HostSide for Hybrid {
    fn connect(&mut self, _from: u32, port: u32) -> io::Result<OwnedFd> {
        // Never waits: this is the VM's connection thread.
        self.dir.connect_now(&format!("{}_{port}", self.host)).map_err(|e| io::Error::new(io::ErrorKind::ConnectionRefused, format!("{e:#}")))
    }
}

impl VsockChannel {
    /// Serves the vsock device of the VM whose NIC socket is `base` (a
    /// plain name in `dir`), for the guest `cid`.
    pub(super) fn new(name: &str, dir: Arc<SocketDir>, base: &str, cid: u32, unsealed: bool) -> Result<VsockChannel> {
        let (vu, host) = (format!("{base}.vsock"), format!("{base}.vsock-host"));
        // The longest name made: a port has at most 10 digits.
        if host.len() + 11 > 100 {
            bail!("vsock: socket name {base} is too long for its vsock sockets ({host}_<port>: at most 100 bytes)");
        }
        let dev = Arc::new(vsock::Device::new(u64::from(cid), MemoryPolicy { allow_unsealed: unsealed }).context("vsock device")?);
        let (l_vu, id_vu) = dir.bind(&vu)?;
        let (l_host, id_host) = match dir.bind(&host) {
            Ok(x) => x,
            Err(e) => {
                dir.remove_if(&vu, id_vu);
                return Err(e);
            }
        };
        let shared = Arc::new(Shared { stop: AtomicBool::new(false), conn: Mutex::new(None), listeners: [l_vu.as_raw_fd(), l_host.as_raw_fd()] });
        let (mux, opener) = Mux::new(dev.clone(), Box::new(Hybrid { dir: dir.clone(), host: host.clone() })).context("vsock connection thread")?;
        let counters = mux.counters.clone();
        let spawn = |what: &str, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(format!("vsock-{what}-{name}")).spawn(f).map(|_| ()).context("cannot start a vsock thread");
        let s = shared.clone();
        spawn("conns", Box::new(move || mux.run(&s.stop)))?;
        let (s, d, l) = (shared.clone(), dev.clone(), l_vu.try_clone()?);
        spawn("vhost", Box::new(move || serve(&s, &d, &l)))?;
        let (s, l) = (shared.clone(), l_host.try_clone()?);
        spawn("host", Box::new(move || accept_host(&s, &l, &opener)))?;
        Ok(VsockChannel { shared, dev, counters, dir, made: vec![(vu, id_vu), (host, id_host)], _listeners: [l_vu, l_host] })
    }

    /// `STATS` lines of the device and its connections.
    pub fn render_stats(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = write!(out, " vsock_cid={}", self.dev.cid());
        // The device's rings, as the NIC's are counted (what the protocol
        // refused, chains that could not be used, rings broken), named
        // `vsock_vhost_*`; the NIC-only ones (frames, held frames) are not.
        const RINGS: [&str; 8] = ["connects", "bad_chains", "long_chains", "broken_rings", "budget_stops", "refused_fds", "refused_memory", "memory_faults"];
        for (name, v) in self.dev.counters.fields() {
            if RINGS.iter().any(|r| name.strip_prefix("vhost_") == Some(r)) {
                let _ = write!(out, " vsock_{name}={v}");
            }
        }
        self.counters.render_into(out);
    }
}

impl Drop for VsockChannel {
    fn drop(&mut self) {
        self.shared.stop.store(true, Relaxed);
        if let Some(c) = self.shared.conn.lock().unwrap().take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        for l in self.shared.listeners {
            // SAFETY: shutdown(2) on our listening sockets wakes their accepts.
            unsafe { libc::shutdown(l, libc::SHUT_RDWR) };
        }
        self.dev.poke();
        for (name, id) in &self.made {
            self.dir.remove_if(name, *id);
        }
    }
}

/// The vhost-user side: one frontend at a time, each served until it goes
/// (its device reset then: the guest's connections are dropped).
fn serve(shared: &Shared, dev: &Arc<vsock::Device>, listener: &UnixListener) {
    accepting(shared, listener, "vhost-user-vsock", |stream| {
        let Ok(conn) = stream.try_clone() else { return };
        *shared.conn.lock().unwrap() = Some(conn);
        let fe = Arc::new(Mutex::new(Fe::new(dev.clone())));
        let mut handler = BackendReqHandler::from_stream(stream, fe.clone());
        dev.counters.connects.fetch_add(1, Relaxed);
        tracing::info!(cid = dev.cid(), "vhost-user-vsock frontend connected");
        while !shared.stop.load(Relaxed) {
            match handler.handle_request() {
                Ok(()) => {}
                Err(e @ (VhostError::InvalidParam | VhostError::InvalidOperation(_) | VhostError::InactiveFeature(_) | VhostError::InactiveOperation(_) | VhostError::ReqHandlerError(_))) => {
                    tracing::debug!("vhost-user-vsock request refused: {e}");
                }
                Err(e) => {
                    if !shared.stop.load(Relaxed) {
                        tracing::info!("vhost-user-vsock frontend gone: {e}");
                    }
                    break;
                }
            }
        }
        fe.lock().unwrap().reset();
        dev.poke();
        *shared.conn.lock().unwrap() = None;
    });
}

/// Accepts on `listener` until vnetd stops the device, each connection
/// handed to `each` in turn.
fn accepting(shared: &Shared, listener: &UnixListener, what: &str, mut each: impl FnMut(UnixStream)) {
    while !shared.stop.load(Relaxed) {
        match listener.accept() {
            Ok((s, _)) => each(s),
            Err(e) => {
                if shared.stop.load(Relaxed) {
                    return;
                }
                tracing::warn!("{what} accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Host programs connecting to `<base>.vsock-host`: `CONNECT <port>\n`,
/// then the guest is asked.
fn accept_host(shared: &Shared, listener: &UnixListener, opener: &Opener) {
    accepting(shared, listener, "vsock host socket", |mut s| {
        match read_connect(&mut s) {
            Ok(port) => {
                if s.set_nonblocking(true).is_ok() {
                    let _ = opener.open(Incoming { fd: OwnedFd::from(s), port, announce: true });
                }
            }
            Err(why) => {
                use std::io::Write;
                let _ = s.write_all(format!("ERR {why}\n").as_bytes());
            }
        }
    });
}

/// Reads `CONNECT <port>\n` a byte at a time (nothing after it is taken:
/// that is the stream's).
fn read_connect(s: &mut UnixStream) -> std::result::Result<u32, String> {
    s.set_read_timeout(Some(CONNECT_LINE_WAIT)).map_err(|e| e.to_string())?;
    let mut line = Vec::with_capacity(32);
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(1) if b[0] == b'\n' => break,
            Ok(1) if line.len() < 32 => line.push(b[0]),
            Ok(1) => return Err("line too long (want CONNECT <port>)".into()),
            Ok(_) => return Err("closed before CONNECT <port>".into()),
            Err(e) => return Err(format!("no CONNECT <port> line: {e}")),
        }
    }
    let line = String::from_utf8_lossy(&line);
    let port = line.trim().strip_prefix("CONNECT ").and_then(|p| p.trim().parse::<u32>().ok());
    let _ = s.set_read_timeout(None);
    port.ok_or_else(|| format!("'{}' is not CONNECT <port>", line.trim()))
}
