//! The handshake that opens a TCP link connection: both ends prove they hold
//! the link's key before a single frame flows, so a process at the peer's
//! address that lacks the key can neither replace the live connection nor
//! read or inject the link's traffic through a connection of its own.
//!
//! Mutual challenge and response with HMAC-SHA256 over fresh 32-byte nonces:
//!
//! ```text
//! initiator -> responder   HELLO    = MAGIC | nonce_i                        (40 bytes)
//! responder -> initiator   CHALLENGE = MAGIC | nonce_r | HMAC(k, "vnet-tcp-link responder" | nonce_i | nonce_r)  (72)
//! initiator -> responder   PROOF    = HMAC(k, "vnet-tcp-link initiator" | nonce_i | nonce_r)                    (32)
//! ```
//!
//! Each side's MAC covers both nonces, so neither can be replayed into
//! another connection, and the two directions use different labels, so a
//! responder's answer cannot be reflected back as an initiator's proof.
//! Comparisons are constant-time. The handshake authenticates the ends of
//! the connection, not each byte after it: it does not encrypt, and an
//! attacker on the path who can forge TCP segments is out of its scope
//! (run the underlay over IPsec or WireGuard for that).
//!
//! The same handshake opens VTOE's shadow connections (`vnet_core::vtoe`),
//! under its own magic and labels (`Proto`), so that a message of one can
//! never pass for the other's even when both use one key; there the
//! initiator's proof also covers the connection request it carries
//! (`answer`'s and `verify_proof`'s `bound`).
//!
//! Pure functions: the caller supplies the nonces (from the OS's random
//! source) and does the I/O.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Which protocol a handshake opens: its magic (which starts every message
/// but the last: protocol and version) and the labels its MACs are bound to.
pub struct Proto {
    pub magic: [u8; 8],
    responder: &'static [u8],
    initiator: &'static [u8],
}

/// TCP links.
pub const TCP_LINK: Proto = Proto { magic: *b"VNETTCP1", responder: b"vnet-tcp-link responder", initiator: b"vnet-tcp-link initiator" };
/// VTOE's shadow connections.
pub const VTOE: Proto = Proto { magic: *b"VNETVTO1", responder: b"vnet-vtoe responder", initiator: b"vnet-vtoe initiator" };

const MAGIC_LEN: usize = 8;
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;
pub const HELLO_LEN: usize = MAGIC_LEN + NONCE_LEN;
pub const CHALLENGE_LEN: usize = MAGIC_LEN + NONCE_LEN + MAC_LEN;
pub const PROOF_LEN: usize = MAC_LEN;
/// Shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;

pub type Nonce = [u8; NONCE_LEN];

/// Why a handshake failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// The message does not start with the protocol's magic (not this
    /// protocol, or another version).
    NotVnet,
    /// The MAC is wrong: the other end does not hold this link's key.
    BadKey,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AuthError::NotVnet => "not this VNET handshake (or another version)",
            AuthError::BadKey => "the peer does not hold this link's key",
        })
    }
}

/// HMAC-SHA256 under `key` of `label`, both nonces and `bound` (what else
/// the MAC vouches for; empty for the handshake alone).
pub fn mac(key: &[u8], label: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, bound: &[u8]) -> [u8; MAC_LEN] {
    let mut m = <Hmac<Sha256>>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(nonce_i);
    m.update(nonce_r);
    m.update(bound);
    m.finalize().into_bytes().into()
}

/// Constant-time comparison of a received MAC with the expected one.
pub fn mac_matches(expect: &[u8; MAC_LEN], got: &[u8]) -> bool {
    bool::from(expect.ct_eq(got))
}

/// The initiator's first message.
pub fn hello(p: &Proto, nonce_i: &Nonce) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(&p.magic);
    out[8..].copy_from_slice(nonce_i);
    out
}

/// Responder: reads a HELLO, returns the initiator's nonce.
pub fn read_hello(p: &Proto, msg: &[u8; HELLO_LEN]) -> Result<Nonce, AuthError> {
    if msg[..8] != p.magic {
        return Err(AuthError::NotVnet);
    }
    Ok(msg[8..].try_into().expect("32 bytes"))
}

/// Responder: the CHALLENGE answering `nonce_i` with its own `nonce_r`.
pub fn challenge(p: &Proto, key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce) -> [u8; CHALLENGE_LEN] {
    let mut out = [0u8; CHALLENGE_LEN];
    out[..8].copy_from_slice(&p.magic);
    out[8..40].copy_from_slice(nonce_r);
    out[40..].copy_from_slice(&mac(key, p.responder, nonce_i, nonce_r, &[]));
    out
}

/// Initiator: checks the responder's CHALLENGE and returns the responder's
/// nonce and the PROOF to send, which also vouches for `bound`.
pub fn answer(p: &Proto, key: &[u8], nonce_i: &Nonce, msg: &[u8; CHALLENGE_LEN], bound: &[u8]) -> Result<(Nonce, [u8; PROOF_LEN]), AuthError> {
    if msg[..8] != p.magic {
        return Err(AuthError::NotVnet);
    }
    let nonce_r: Nonce = msg[8..40].try_into().expect("32 bytes");
    let expect = mac(key, p.responder, nonce_i, &nonce_r, &[]);
    if !mac_matches(&expect, &msg[40..]) {
        return Err(AuthError::BadKey);
    }
    Ok((nonce_r, mac(key, p.initiator, nonce_i, &nonce_r, bound)))
}

/// Responder: checks the initiator's PROOF (of the handshake and `bound`).
pub fn verify_proof(p: &Proto, key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, proof: &[u8; PROOF_LEN], bound: &[u8]) -> Result<(), AuthError> {
    if mac_matches(&mac(key, p.initiator, nonce_i, nonce_r, bound), proof) {
        Ok(())
    } else {
        Err(AuthError::BadKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn both_ends_with_the_key_agree() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let got_ni = read_hello(&TCP_LINK, &hello(&TCP_LINK, &ni)).unwrap();
        assert_eq!(got_ni, ni);
        let ch = challenge(&TCP_LINK, K, &got_ni, &nr);
        let (got_nr, proof) = answer(&TCP_LINK, K, &ni, &ch, &[]).unwrap();
        assert_eq!(got_nr, nr);
        assert_eq!(verify_proof(&TCP_LINK, K, &ni, &nr, &proof, &[]), Ok(()));
    }

    #[test]
    fn a_responder_without_the_key_is_refused() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = challenge(&TCP_LINK, b"another key of enough length....", &ni, &nr);
        assert_eq!(answer(&TCP_LINK, K, &ni, &ch, &[]), Err(AuthError::BadKey));
    }

    #[test]
    fn an_initiator_without_the_key_is_refused() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = challenge(&TCP_LINK, K, &ni, &nr);
        let other = b"another key of enough length....";
        let (_, forged) = answer(&TCP_LINK, other, &ni, &challenge(&TCP_LINK, other, &ni, &nr), &[]).unwrap();
        assert_eq!(verify_proof(&TCP_LINK, K, &ni, &nr, &forged, &[]), Err(AuthError::BadKey));
        // Reflecting the responder's own MAC back does not pass either.
        let reflected: [u8; 32] = ch[40..].try_into().unwrap();
        assert_eq!(verify_proof(&TCP_LINK, K, &ni, &nr, &reflected, &[]), Err(AuthError::BadKey));
    }

    #[test]
    fn a_proof_from_another_connection_is_refused() {
        let ni = [1u8; 32];
        let (_, proof) = answer(&TCP_LINK, K, &ni, &challenge(&TCP_LINK, K, &ni, &[2u8; 32]), &[]).unwrap();
        // Same initiator nonce, but the responder chose a new one.
        assert_eq!(verify_proof(&TCP_LINK, K, &ni, &[3u8; 32], &proof, &[]), Err(AuthError::BadKey));
    }

    #[test]
    fn other_protocols_are_told_apart() {
        let mut h = hello(&TCP_LINK, &[0u8; 32]);
        h[..8].copy_from_slice(b"GET / HT");
        assert_eq!(read_hello(&TCP_LINK, &h), Err(AuthError::NotVnet));
        let mut ch = challenge(&TCP_LINK, K, &[0u8; 32], &[0u8; 32]);
        ch[7] = b'2';
        assert_eq!(answer(&TCP_LINK, K, &[0u8; 32], &ch, &[]), Err(AuthError::NotVnet));
    }

    #[test]
    fn every_bit_of_the_mac_counts() {
        let (ni, nr) = ([7u8; 32], [9u8; 32]);
        let ch = challenge(&TCP_LINK, K, &ni, &nr);
        for byte in 40..CHALLENGE_LEN {
            let mut bad = ch;
            bad[byte] ^= 0x01;
            assert_eq!(answer(&TCP_LINK, K, &ni, &bad, &[]), Err(AuthError::BadKey), "byte {byte}");
        }
    }

    #[test]
    fn one_protocol_cannot_pass_for_the_other_under_the_same_key() {
        let (ni, nr) = ([4u8; 32], [5u8; 32]);
        // A TCP link's HELLO and CHALLENGE are not VTOE's, and back.
        assert_eq!(read_hello(&VTOE, &hello(&TCP_LINK, &ni)), Err(AuthError::NotVnet));
        assert_eq!(answer(&TCP_LINK, K, &ni, &challenge(&VTOE, K, &ni, &nr), &[]), Err(AuthError::NotVnet));
        // Even with the magic rewritten, the labels differ.
        let mut ch = challenge(&VTOE, K, &ni, &nr);
        ch[..8].copy_from_slice(&TCP_LINK.magic);
        assert_eq!(answer(&TCP_LINK, K, &ni, &ch, &[]), Err(AuthError::BadKey));
        let (_, proof) = answer(&TCP_LINK, K, &ni, &challenge(&TCP_LINK, K, &ni, &nr), &[]).unwrap();
        assert_eq!(verify_proof(&VTOE, K, &ni, &nr, &proof, &[]), Err(AuthError::BadKey));
    }

    #[test]
    fn a_proof_vouches_for_what_it_is_bound_to() {
        let (ni, nr) = ([6u8; 32], [7u8; 32]);
        let (_, proof) = answer(&VTOE, K, &ni, &challenge(&VTOE, K, &ni, &nr), b"request A").unwrap();
        assert_eq!(verify_proof(&VTOE, K, &ni, &nr, &proof, b"request A"), Ok(()));
        assert_eq!(verify_proof(&VTOE, K, &ni, &nr, &proof, b"request B"), Err(AuthError::BadKey));
    }
}
