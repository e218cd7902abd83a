//! WireGuard sessions across a hand-over (`vnetd --takeover`): the running
//! vnetd writes out every link's tunnel (its sessions' keys, counters and
//! replay windows, its timers: boringtun's `Tunn::export_state`, which
//! third_party/boringtun adds) with the link's index and endpoint, and the
//! new vnetd's link to the same peer goes on from there: no new handshake,
//! no frame waiting for one, the peer sees nothing.
//!
//! The hub offers one state, `wireguard` (`sys::keep`), written when the
//! hand-over is agreed and every dispatcher has stopped. Writing a link out
//! retires its tunnel in this process (`Peer::handed_over`): nothing more
//! is sealed or sent through it, so the successor's counters are never
//! used twice (a repeated nonce would break ChaCha20-Poly1305). It travels
//! only over the hand-over socket (mode 0600, same user), never to disk or
//! to systemd's store: a crash costs a new handshake (docs/operations.md).
//!
//! The text, a line each:
//!
//! ```text
//! wireguard-kept 1
//! public <our public key>        (another key: nothing is taken on)
//! accepted <peer key> <hex>      (each peer's newest accepted initiation)
//! peer <key> index <n> endpoint <addr> sessions <n>
//! tunn <current> <next index> <newest TAI64N hex> <tx> <rx> <initiator> <age ns> <want keepalive> <want handshake>
//! timers <ns>...
//! session-timers <ns>...
//! session <rx index> <tx index> <rx key hex> <tx key hex> <tx counter> <rx next> <rx count> <bitmap hex>
//! ```

use super::{Peer, WgHub, WgLink, INIT_LEN};
use boringtun::noise::{SessionExport, TunnExport};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use vnet_core::command::{parse_wireguard_key, wireguard_key_text};

/// The state's name in `sys::keep`.
pub const NAME: &str = "wireguard";
const HEADER: &str = "wireguard-kept 1";

/// One link's tunnel as written out.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptLink {
    pub index: u32,
    pub endpoint: SocketAddr,
    pub sessions: u64,
    pub tunn: TunnExport,
}

/// What a hub was handed: each peer's tunnel, each peer's newest
/// initiation.
#[derive(Debug, Default, PartialEq)]
pub struct Kept {
    pub links: HashMap<[u8; 32], KeptLink>,
    pub accepted: HashMap<[u8; 32], [u8; INIT_LEN]>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Result<[u8; N], String> {
    if s.len() != 2 * N || !s.is_ascii() {
        return Err(format!("{} hex digits, not {N} bytes", s.len()));
    }
    let mut out = [0u8; N];
    for (k, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * k..2 * k + 2], 16).map_err(|_| format!("not hex: {s}"))?;
    }
    Ok(out)
}

fn ns(d: &Duration) -> String {
    d.as_nanos().to_string()
}

fn durations(words: &[&str]) -> Result<Vec<Duration>, String> {
    words.iter().map(|w| w.parse::<u64>().map(Duration::from_nanos).map_err(|_| format!("not a duration: {w}"))).collect()
}

fn num<T: std::str::FromStr>(w: Option<&&str>) -> Result<T, String> {
    let w = w.ok_or("a field is missing")?;
    w.parse().map_err(|_| format!("not a number: {w}"))
}

fn flag(w: Option<&&str>) -> Result<bool, String> {
    Ok(num::<u8>(w)? != 0)
}

/// Writes `link`'s tunnel out and retires it here (see the module's
/// comment); None if it was written out already.
fn write_link(link: &WgLink, out: &mut String) {
    let mut g = link.lock();
    if g.handed_over {
        return;
    }
    g.handed_over = true;
    write_peer(&link.peer, link.index, &g, out);
}

fn write_peer(peer: &[u8; 32], index: u32, g: &Peer, out: &mut String) {
    use std::fmt::Write;
    let e = g.tunn.export_state();
    let t = &e.timers;
    let _ = writeln!(out, "peer {} index {index} endpoint {} sessions {}", wireguard_key_text(peer), g.endpoint, g.sessions);
    let _ = writeln!(
        out,
        "tunn {} {} {} {} {} {} {} {} {}",
        e.current,
        e.next_index,
        hex(&e.newest_initiation),
        e.tx_bytes,
        e.rx_bytes,
        t.is_initiator as u8,
        ns(&t.age),
        t.want_keepalive as u8,
        t.want_handshake as u8
    );
    let _ = writeln!(out, "timers {}", t.timers.iter().map(ns).collect::<Vec<_>>().join(" "));
    let _ = writeln!(out, "session-timers {}", t.session_timers.iter().map(ns).collect::<Vec<_>>().join(" "));
    for s in &e.sessions {
        let bitmap: Vec<u8> = s.receiving_bitmap.iter().flat_map(|w| w.to_be_bytes()).collect();
        let _ = writeln!(
            out,
            "session {} {} {} {} {} {} {} {}",
            s.receiving_index,
            s.sending_index,
            hex(&s.receiving_key),
            hex(&s.sending_key),
            s.sending_counter,
            s.receiving_next,
            s.receiving_count,
            hex(&bitmap)
        );
    }
}

/// The hub's state for a successor: every live link written out (and
/// retired), and each peer's newest initiation.
pub fn write(hub: &WgHub) -> String {
    let mut out = format!("{HEADER}\npublic {}\n", hub.public_text());
    for (peer, init) in hub.accepted.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        out.push_str(&format!("accepted {} {}\n", wireguard_key_text(peer), hex(init)));
    }
    for link in hub.live_peers() {
        write_link(&link, &mut out);
    }
    out
}

/// Reads what `write` wrote, for a hub whose public key is `public`.
pub fn read(text: &str, public: &str) -> Result<Kept, String> {
    let mut lines = text.lines().enumerate();
    if lines.next().map(|l| l.1) != Some(HEADER) {
        return Err(format!("not a state this vnetd reads (want {HEADER:?} first)"));
    }
    let mut kept = Kept::default();
    let mut at: Option<([u8; 32], KeptLink)> = None;
    let mut ours = false;
    for (n, line) in lines {
        let w: Vec<&str> = line.split(' ').collect();
        let r: Result<(), String> = (|| {
            match w[0] {
                "public" if w.len() == 2 => {
                    if w[1] != public {
                        return Err(format!("written for public key {}, this vnetd's is {public}", w[1]));
                    }
                    ours = true;
                }
                _ if !ours => return Err("no `public` line before it: written for which key?".into()),
                "accepted" if w.len() == 3 => {
                    kept.accepted.insert(parse_wireguard_key(w[1])?, unhex::<INIT_LEN>(w[2])?);
                }
                "peer" if w.len() == 8 && (w[2], w[4], w[6]) == ("index", "endpoint", "sessions") => {
                    if let Some((k, l)) = at.take() {
                        kept.links.insert(k, l);
                    }
                    let index: u32 = num(w.get(3))?;
                    if index > 0x00ff_ffff {
                        return Err(format!("index {index} is over 24 bits"));
                    }
                    let link = KeptLink {
                        index,
                        endpoint: w[5].parse().map_err(|_| format!("not an address: {}", w[5]))?,
                        sessions: num(w.get(7))?,
                        tunn: TunnExport::default(),
                    };
                    at = Some((parse_wireguard_key(w[1])?, link));
                }
                "tunn" if w.len() == 10 => {
                    let t = &mut at.as_mut().ok_or("tunn before peer")?.1.tunn;
                    t.current = num(w.get(1))?;
                    t.next_index = num(w.get(2))?;
                    t.newest_initiation = unhex::<12>(w[3])?;
                    t.tx_bytes = num(w.get(4))?;
                    t.rx_bytes = num(w.get(5))?;
                    t.timers.is_initiator = flag(w.get(6))?;
                    t.timers.age = Duration::from_nanos(num(w.get(7))?);
                    t.timers.want_keepalive = flag(w.get(8))?;
                    t.timers.want_handshake = flag(w.get(9))?;
                }
                "timers" => at.as_mut().ok_or("timers before peer")?.1.tunn.timers.timers = durations(&w[1..])?,
                "session-timers" => at.as_mut().ok_or("session-timers before peer")?.1.tunn.timers.session_timers = durations(&w[1..])?,
                "session" if w.len() == 9 => {
                    let t = &mut at.as_mut().ok_or("session before peer")?.1.tunn;
                    let bytes = unhex::<128>(w[8])?;
                    let mut bitmap = [0u64; 16];
                    for (k, b) in bitmap.iter_mut().enumerate() {
                        *b = u64::from_be_bytes(bytes[8 * k..8 * k + 8].try_into().unwrap_or_default());
                    }
                    t.sessions.push(SessionExport {
                        receiving_index: num(w.get(1))?,
                        sending_index: num(w.get(2))?,
                        receiving_key: unhex::<32>(w[3])?,
                        sending_key: unhex::<32>(w[4])?,
                        sending_counter: num(w.get(5))?,
                        receiving_next: num(w.get(6))?,
                        receiving_count: num(w.get(7))?,
                        receiving_bitmap: bitmap,
                    });
                }
                _ => return Err("not a line of this state".into()),
            }
            Ok(())
        })();
        r.map_err(|e| format!("line {}: {e}", n + 1))?;
    }
    if let Some((k, l)) = at.take() {
        kept.links.insert(k, l);
    }
    Ok(kept)
}

/// A hub's successor, at its start: takes what its predecessor handed
/// over, if anything (logged; a state it cannot read costs each link a
/// new handshake, nothing else).
pub fn take(hub: &WgHub) {
    let Some((text, _)) = crate::sys::keep::take_state(NAME) else { return };
    match read(&text, &hub.public_text()) {
        Ok(k) => {
            tracing::info!("hand-over: {} WireGuard session(s) taken on", k.links.len());
            hub.accepted.lock().unwrap_or_else(|p| p.into_inner()).extend(k.accepted);
            *hub.kept.lock().unwrap_or_else(|p| p.into_inner()) = k.links;
        }
        Err(e) => tracing::warn!("hand-over: the WireGuard sessions handed over are not taken on ({e}): each link makes a new handshake"),
    }
}

/// The tunnel handed over for the link being made to `peer`, if any, and
/// if its index is free (no link of this vnetd has it).
pub fn for_link(hub: &WgHub, peer: &[u8; 32]) -> Option<KeptLink> {
    let k = hub.kept.lock().unwrap_or_else(|p| p.into_inner()).remove(peer)?;
    let taken = hub.live_peers().iter().any(|l| l.index == k.index);
    if taken {
        tracing::warn!(peer = %wireguard_key_text(peer), "hand-over: the WireGuard session's index is taken here: a new handshake");
        return None;
    }
    hub.counters.sessions_taken_over.fetch_add(1, Relaxed);
    Some(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use boringtun::noise::{Tunn, TunnResult};
    use boringtun::x25519::{PublicKey, StaticSecret};

    fn pair() -> (Tunn, Tunn, StaticSecret, PublicKey) {
        let secret = || {
            let mut k = [0u8; 32];
            getrandom::getrandom(&mut k).unwrap();
            StaticSecret::from(k)
        };
        let (a, b) = (secret(), secret());
        let (pa, pb) = (PublicKey::from(&a), PublicKey::from(&b));
        let ta = Tunn::new(a.clone(), pb, None, None, 7, None).unwrap();
        let tb = Tunn::new(b, pa, None, None, 9, None).unwrap();
        (ta, tb, a, pb)
    }

    /// `from` seals `packet`; `to` opens it: the packet it opened to, or
    /// the error.
    fn carry(from: &mut Tunn, to: &mut Tunn, packet: &[u8]) -> Result<Vec<u8>, String> {
        let (mut o1, mut o2) = (vec![0u8; 2048], vec![0u8; 2048]);
        let d = match from.encapsulate(packet, &mut o1) {
            TunnResult::WriteToNetwork(d) => d.to_vec(),
            other => return Err(format!("{other:?}")),
        };
        match to.decapsulate(None, &d, &mut o2) {
            TunnResult::WriteToTunnelV4(p, _) => Ok(p.to_vec()),
            TunnResult::Err(e) => Err(format!("{e:?}")),
            other => Err(format!("{other:?}")),
        }
    }

    fn handshake(a: &mut Tunn, b: &mut Tunn) {
        let (mut o1, mut o2, mut o3) = (vec![0u8; 2048], vec![0u8; 2048], vec![0u8; 2048]);
        let TunnResult::WriteToNetwork(init) = a.format_handshake_initiation(&mut o1, false) else { panic!() };
        let TunnResult::WriteToNetwork(resp) = b.decapsulate(None, init, &mut o2) else { panic!() };
        let TunnResult::WriteToNetwork(keepalive) = a.decapsulate(None, resp, &mut o3) else { panic!() };
        assert!(matches!(b.decapsulate(None, keepalive, &mut o1), TunnResult::Done));
    }

    /// A 20-byte IPv4 header and a payload: what a WireGuard tunnel carries.
    fn ip(payload: u8) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 24, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2, payload, 0, 0, 0];
        p[2..4].copy_from_slice(&24u16.to_be_bytes());
        p
    }

    #[test]
    fn a_tunnel_written_out_and_read_goes_on_with_no_handshake_and_refuses_replays() {
        let (mut a, mut b, a_secret, b_public) = pair();
        handshake(&mut a, &mut b);
        for k in 0..5 {
            assert_eq!(carry(&mut a, &mut b, &ip(k)).unwrap(), ip(k));
            assert_eq!(carry(&mut b, &mut a, &ip(k)).unwrap(), ip(k));
        }
        // A datagram b sent before the hand-over, kept to replay after it.
        let mut o = vec![0u8; 2048];
        let TunnResult::WriteToNetwork(old) = b.encapsulate(&ip(99), &mut o) else { panic!() };
        let old = old.to_vec();
        assert!(matches!(a.decapsulate(None, &old, &mut vec![0u8; 2048]), TunnResult::WriteToTunnelV4(..)));

        // a is written out as text and read back into a new Tunn (same keys).
        let peer = [3u8; 32];
        let g = Peer { tunn: a, endpoint: "192.0.2.1:51820".parse().unwrap(), waiting: 0, sessions: 1, fresh: false, flush_asked: false, cookie_retry: None, handed_over: true };
        let mut text = format!("{HEADER}\npublic me\n");
        write_peer(&peer, 7, &g, &mut text);
        let kept = read(&text, "me").unwrap();
        let k = &kept.links[&peer];
        assert_eq!((k.index, k.endpoint, k.sessions), (7, g.endpoint, 1));
        let mut now = g.tunn.export_state();
        assert!(now.timers.age >= k.tunn.timers.age, "the tunnel's age");
        now.timers.age = k.tunn.timers.age;
        assert_eq!(k.tunn, now, "the text holds the whole export");
        let mut a2 = Tunn::new(a_secret, b_public, None, None, 7, None).unwrap();
        assert!(a2.import_state(&k.tunn));

        // Both ways at once, no handshake: the counters go on.
        for k in 10..15 {
            assert_eq!(carry(&mut a2, &mut b, &ip(k)).unwrap(), ip(k));
            assert_eq!(carry(&mut b, &mut a2, &ip(k)).unwrap(), ip(k));
        }
        // The replay window came along: the old datagram is refused.
        let mut o = vec![0u8; 2048];
        let r = a2.decapsulate(None, &old, &mut o);
        assert!(matches!(r, TunnResult::Err(_)), "a replayed datagram opened after the hand-over: {r:?}");
        // The timers too: no handshake is due.
        assert!(!matches!(a2.update_timers(&mut vec![0u8; 2048]), TunnResult::WriteToNetwork(_)));
        assert!(a2.time_since_last_handshake().is_some_and(|d| d < Duration::from_secs(5)));
    }

    #[test]
    fn a_state_for_another_key_or_malformed_is_refused_with_the_line() {
        assert!(read("wireguard-kept 1\npublic abc\n", "xyz").unwrap_err().contains("public key"));
        assert!(read("wireguard-kept 2\n", "x").is_err());
        let e = read("wireguard-kept 1\naccepted x y\n", "x").unwrap_err();
        assert!(e.contains("no `public` line"), "{e}");
        let e = read("wireguard-kept 1\npublic x\ntunn 0 0 00 0 0 0 0 0 0\n", "x").unwrap_err();
        assert!(e.starts_with("line 3:"), "{e}");
        let e = read("wireguard-kept 1\npublic x\nsession 1 2 zz\n", "x").unwrap_err();
        assert!(e.contains("line 3"), "{e}");
    }
}
