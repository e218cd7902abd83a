//! Who may use the control plane, and as what.
//!
//! - On the Unix socket a peer is known by its kernel credentials
//!   (`SO_PEERCRED`, `SO_PEERGROUPS`): root and vnetd's own user are
//!   administrators; members of the group named by `--control-group` get
//!   that group's role; everyone else is refused, whatever the socket file's
//!   mode says.
//! - On TCP a peer is known only by what it says first: `AUTH <token>`, with
//!   the administrators' token or the readers' token.
//!
//! A reader may run SHOW, STATS, the LISTs and HELP; an administrator may
//! also change state. Sessions are capped per listener and per client, and
//! an address that keeps giving bad tokens is locked out for a while.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a control session may do.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// SHOW, STATS, the LISTs, HELP.
    Read,
    /// Everything, changes included.
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Result<Role, String> {
        match s.to_ascii_lowercase().as_str() {
            "read" => Ok(Role::Read),
            "admin" => Ok(Role::Admin),
            _ => Err(format!("'{s}' is not a role (want read or admin)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Admin => "admin",
        }
    }
}

/// The party behind a control request: its role, and how it is named in
/// the log and in refusals.
#[derive(Clone, Debug)]
pub struct Caller {
    pub role: Role,
    pub who: String,
}

impl Caller {
    /// The daemon's own config file, given on its command line.
    pub fn config(path: &std::path::Path) -> Caller {
        Caller { role: Role::Admin, who: format!("config {}", path.display()) }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} (role {})", self.who, self.role.name())
    }
}

/// A Unix-socket peer's credentials, as the kernel recorded them at connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCreds {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

/// Reads a connected Unix socket's peer credentials.
pub fn peer_creds(fd: BorrowedFd) -> io::Result<PeerCreds> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let c = getsockopt(&fd, PeerCredentials).map_err(io::Error::from)?;
    Ok(PeerCreds { pid: c.pid(), uid: c.uid(), gid: c.gid(), groups: peer_groups(fd)? })
}

/// `SO_PEERGROUPS`: the peer's supplementary groups at connect time.
fn peer_groups(fd: BorrowedFd) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `groups` is valid for writes of `len` bytes; the kernel
        // writes at most that and reports the size it needs.
        let r = unsafe {
            libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 65_536 {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

/// Who may use the Unix socket.
#[derive(Clone, Debug)]
pub struct UnixPolicy {
    /// vnetd's own effective user (root, or a user given CAP_NET_ADMIN).
    pub daemon_uid: u32,
    /// `--control-group`: its gid and the role its members get.
    pub group: Option<(u32, Role)>,
}

impl UnixPolicy {
    /// The role of a peer, or why it is refused.
    pub fn admit(&self, c: &PeerCreds) -> Result<Role, String> {
        if c.uid == 0 || c.uid == self.daemon_uid {
            return Ok(Role::Admin);
        }
        match self.group {
            Some((gid, role)) if c.gid == gid || c.groups.contains(&gid) => Ok(role),
            Some((gid, _)) => Err(format!("uid {} is not root or a member of the control group (gid {gid})", c.uid)),
            None => Err(format!("uid {} is not root (vnetd names no --control-group)", c.uid)),
        }
    }

    /// Whether a peer is an administrator by who it is (not by group): such
    /// peers have their own sessions that nobody else can take.
    pub fn is_superuser(&self, uid: u32) -> bool {
        uid == 0 || uid == self.daemon_uid
    }
}

/// The TCP tokens: one for administrators, one for readers (either may be
/// absent, not both).
pub struct Tokens {
    admin: Option<String>,
    read: Option<String>,
}

impl Tokens {
    pub fn new(admin: Option<String>, read: Option<String>) -> Result<Tokens, String> {
        if admin.is_none() && read.is_none() {
            return Err("no token".into());
        }
        if admin.is_some() && admin == read {
            return Err("the admin and read tokens must differ".into());
        }
        Ok(Tokens { admin, read })
    }

    /// The role a presented token grants. Both tokens are always compared,
    /// each in time that depends only on the lengths.
    pub fn check(&self, given: &str) -> Option<Role> {
        let admin = self.admin.as_deref().is_some_and(|t| same_secret(t, given));
        let read = self.read.as_deref().is_some_and(|t| same_secret(t, given));
        match (admin, read) {
            (true, _) => Some(Role::Admin),
            (false, true) => Some(Role::Read),
            _ => None,
        }
    }
}

/// Compares two strings in time that depends only on their lengths.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Bad tokens in a row, from one address, before it is locked out.
pub const MAX_AUTH_FAILURES: u32 = 5;
/// How long a locked-out address is refused.
pub const LOCKOUT: Duration = Duration::from_secs(60);
/// A failure older than this is forgotten.
const FAILURE_MEMORY: Duration = Duration::from_secs(600);
/// Most addresses remembered; past it the stalest is forgotten.
const MAX_REMEMBERED: usize = 16_384;

/// Failed AUTH attempts by client address (IPv6 by /64, since one host
/// holds a whole /64). Locks an address out after `MAX_AUTH_FAILURES` bad
/// tokens in a row for `LOCKOUT`, even for a right token.
#[derive(Default)]
pub struct Lockout {
    by_addr: Mutex<HashMap<IpAddr, Failures>>,
}

#[derive(Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
    locked_until: Option<Instant>,
}

fn addr_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & (!0u128 << 64)).into()),
        },
    }
}

impl Lockout {
    /// How much longer `ip` is locked out, if it is.
    pub fn locked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let map = self.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        let until = map.get(&addr_key(ip))?.locked_until?;
        (until > now).then(|| until - now)
    }

    /// Records a bad token from `ip`; returns true when this one locks it out.
    pub fn failed(&self, ip: IpAddr, now: Instant) -> bool {
        let mut map = self.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        let key = addr_key(ip);
        if !map.contains_key(&key) && map.len() >= MAX_REMEMBERED {
            map.retain(|_, f| now.duration_since(f.last) < FAILURE_MEMORY || f.locked_until.is_some_and(|u| u > now));
            if map.len() >= MAX_REMEMBERED {
                if let Some(stalest) = map.iter().min_by_key(|(_, f)| f.last).map(|(k, _)| *k) {
                    map.remove(&stalest);
                }
            }
        }
        let f = map.entry(key).or_insert(Failures { count: 0, last: now, locked_until: None });
        if now.duration_since(f.last) >= FAILURE_MEMORY || f.locked_until.is_some_and(|u| u <= now) {
            *f = Failures { count: 0, last: now, locked_until: None };
        }
        f.count += 1;
        f.last = now;
        if f.count >= MAX_AUTH_FAILURES {
            f.locked_until = Some(now + LOCKOUT);
            return true;
        }
        false
    }

    /// A right token from `ip`: its bad ones are forgotten.
    pub fn succeeded(&self, ip: IpAddr) {
        self.by_addr.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr_key(ip));
    }
}

/// Who a session counts against.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Client {
    Uid(u32),
    Addr(IpAddr),
}

impl Client {
    pub fn addr(ip: IpAddr) -> Client {
        Client::Addr(addr_key(ip))
    }
}

/// Caps the sessions of one listener: at most `total`, at most `per_client`
/// from any one client. A session holds a `Ticket`; dropping it frees the slot.
pub struct Gate {
    name: &'static str,
    total: usize,
    per_client: usize,
    state: Mutex<(usize, HashMap<Client, usize>)>,
}

pub struct Ticket {
    gate: Arc<Gate>,
    client: Client,
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Ticket({}, {:?})", self.gate.name, self.client)
    }
}

impl Gate {
    pub fn new(name: &'static str, total: usize, per_client: usize) -> Arc<Gate> {
        Arc::new(Gate { name, total, per_client, state: Mutex::new((0, HashMap::new())) })
    }

    pub fn enter(self: &Arc<Self>, client: Client) -> Result<Ticket, String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_client) = &mut *st;
        if *total >= self.total {
            return Err(format!("too many {} control sessions (at most {})", self.name, self.total));
        }
        let mine = by_client.entry(client).or_insert(0);
        if *mine >= self.per_client {
            return Err(format!("too many control sessions from this client (at most {})", self.per_client));
        }
        *mine += 1;
        *total += 1;
        Ok(Ticket { gate: self.clone(), client })
    }

    #[cfg(test)]
    fn open(&self) -> usize {
        self.state.lock().unwrap().0
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = self.gate.state.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_client) = &mut *st;
        *total -= 1;
        if let Some(n) = by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                by_client.remove(&self.client);
            }
        }
    }
}

/// Requests a session may make: `RATE` a second, in bursts of at most
/// `BURST` (a token bucket).
pub struct RateLimit {
    tokens: f64,
    last: Instant,
}

pub const RATE: f64 = 1000.0;
pub const BURST: f64 = 100.0;

impl RateLimit {
    pub fn new(now: Instant) -> RateLimit {
        RateLimit { tokens: BURST, last: now }
    }

    /// Takes one request's token; returns how long to wait first.
    pub fn take(&mut self, now: Instant) -> Duration {
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * RATE).min(BURST);
        self.last = now;
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / RATE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(uid: u32, gid: u32, groups: &[u32]) -> PeerCreds {
        PeerCreds { pid: 1, uid, gid, groups: groups.to_vec() }
    }

    #[test]
    fn unix_policy_admits_root_the_daemon_user_and_the_group_only() {
        let closed = UnixPolicy { daemon_uid: 0, group: None };
        assert_eq!(closed.admit(&creds(0, 0, &[])), Ok(Role::Admin));
        assert!(closed.admit(&creds(65534, 65534, &[])).unwrap_err().contains("uid 65534 is not root"));
        let group = UnixPolicy { daemon_uid: 990, group: Some((4242, Role::Read)) };
        assert_eq!(group.admit(&creds(990, 990, &[])), Ok(Role::Admin));
        assert_eq!(group.admit(&creds(1000, 4242, &[])), Ok(Role::Read), "primary group");
        assert_eq!(group.admit(&creds(1000, 100, &[27, 4242])), Ok(Role::Read), "supplementary group");
        assert!(group.admit(&creds(1000, 100, &[27, 4243])).is_err());
        let admins = UnixPolicy { daemon_uid: 0, group: Some((4242, Role::Admin)) };
        assert_eq!(admins.admit(&creds(1000, 100, &[4242])), Ok(Role::Admin));
    }

    #[test]
    fn tokens_grant_their_role_and_nothing_else() {
        let t = Tokens::new(Some("admin-token-0123456".into()), Some("read-token-01234567".into())).unwrap();
        assert_eq!(t.check("admin-token-0123456"), Some(Role::Admin));
        assert_eq!(t.check("read-token-01234567"), Some(Role::Read));
        assert_eq!(t.check("admin-token-012345"), None, "a prefix is not the token");
        assert_eq!(t.check("admin-token-01234567"), None);
        assert_eq!(t.check(""), None);
        let read_only = Tokens::new(None, Some("read-token-01234567".into())).unwrap();
        assert_eq!(read_only.check("read-token-01234567"), Some(Role::Read));
        assert_eq!(read_only.check(""), None);
        assert!(Tokens::new(None, None).is_err());
        assert!(Tokens::new(Some("same-token-0123456".into()), Some("same-token-0123456".into())).is_err());
    }

    #[test]
    fn an_address_is_locked_out_after_repeated_bad_tokens_then_let_in_again() {
        let l = Lockout::default();
        let (a, b) = ("198.18.0.2".parse().unwrap(), "198.18.0.3".parse().unwrap());
        let t0 = Instant::now();
        for i in 1..MAX_AUTH_FAILURES {
            assert!(!l.failed(a, t0), "failure {i} does not lock out yet");
            assert_eq!(l.locked(a, t0), None);
        }
        assert!(l.failed(a, t0));
        assert_eq!(l.locked(a, t0), Some(LOCKOUT));
        assert_eq!(l.locked(b, t0), None, "other addresses are not affected");
        assert_eq!(l.locked(a, t0 + LOCKOUT), None, "the lockout ends");
        assert!(!l.failed(a, t0 + LOCKOUT), "and the count starts again");
        // A right token forgets the bad ones.
        for _ in 1..MAX_AUTH_FAILURES {
            l.failed(b, t0);
        }
        l.succeeded(b);
        assert!(!l.failed(b, t0));
    }

    #[test]
    fn ipv6_addresses_count_by_their_64_prefix() {
        let l = Lockout::default();
        let t0 = Instant::now();
        for i in 0..MAX_AUTH_FAILURES {
            l.failed(format!("fd00:1:2:3::{:x}", i + 1).parse().unwrap(), t0);
        }
        assert!(l.locked("fd00:1:2:3::ffff".parse().unwrap(), t0).is_some());
        assert!(l.locked("fd00:1:2:4::1".parse().unwrap(), t0).is_none());
        assert_eq!(addr_key("::ffff:198.18.0.2".parse().unwrap()), "198.18.0.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn the_gate_caps_sessions_per_client_and_in_total_and_frees_them() {
        let g = Gate::new("test", 3, 2);
        let a1 = g.enter(Client::Uid(1)).unwrap();
        let _a2 = g.enter(Client::Uid(1)).unwrap();
        assert!(g.enter(Client::Uid(1)).unwrap_err().contains("from this client (at most 2)"));
        let _b1 = g.enter(Client::Uid(2)).unwrap();
        assert!(g.enter(Client::Uid(3)).unwrap_err().contains("at most 3"));
        drop(a1);
        assert_eq!(g.open(), 2);
        let _c = g.enter(Client::Uid(3)).unwrap();
    }

    #[test]
    fn the_rate_limit_allows_a_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(t0);
        for _ in 0..BURST as usize {
            assert_eq!(r.take(t0), Duration::ZERO);
        }
        let wait = r.take(t0);
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(1), "{wait:?}");
        // One second later a full second's worth is back, capped at the burst.
        let t1 = t0 + Duration::from_secs(1);
        let mut n = 0;
        while r.take(t1) == Duration::ZERO {
            n += 1;
        }
        assert_eq!(n, BURST as usize);
    }
}
