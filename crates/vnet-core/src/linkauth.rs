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
//! Pure functions: the caller supplies the nonces (from the OS's random
//! source) and does the I/O.

use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Starts every handshake message but the last: protocol and version.
pub const MAGIC: [u8; 8] = *b"VNETTCP1";
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;
pub const HELLO_LEN: usize = MAGIC.len() + NONCE_LEN;
pub const CHALLENGE_LEN: usize = MAGIC.len() + NONCE_LEN + MAC_LEN;
pub const PROOF_LEN: usize = MAC_LEN;
/// Shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;

const RESPONDER: &[u8] = b"vnet-tcp-link responder";
const INITIATOR: &[u8] = b"vnet-tcp-link initiator";

pub type Nonce = [u8; NONCE_LEN];

/// Why a handshake failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// The message does not start with `MAGIC` (not a VNET TCP link, or
    /// another version).
    NotVnet,
    /// The MAC is wrong: the other end does not hold this link's key.
    BadKey,
}

impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AuthError::NotVnet => "not a VNET TCP link handshake (or another version)",
            AuthError::BadKey => "the peer does not hold this link's key",
        })
    }
}

fn mac(key: &[u8], label: &[u8], nonce_i: &Nonce, nonce_r: &Nonce) -> [u8; MAC_LEN] {
    let mut m = <Hmac<Sha256>>::new_from_slice(key).expect("HMAC takes keys of any length");
    m.update(label);
    m.update(nonce_i);
    m.update(nonce_r);
    m.finalize().into_bytes().into()
}

/// The initiator's first message.
pub fn hello(nonce_i: &Nonce) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..].copy_from_slice(nonce_i);
    out
}

/// Responder: reads a HELLO, returns the initiator's nonce.
pub fn read_hello(msg: &[u8; HELLO_LEN]) -> Result<Nonce, AuthError> {
    if msg[..8] != MAGIC {
        return Err(AuthError::NotVnet);
    }
    Ok(msg[8..].try_into().expect("32 bytes"))
}

/// Responder: the CHALLENGE answering `nonce_i` with its own `nonce_r`.
pub fn challenge(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce) -> [u8; CHALLENGE_LEN] {
    let mut out = [0u8; CHALLENGE_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..40].copy_from_slice(nonce_r);
    out[40..].copy_from_slice(&mac(key, RESPONDER, nonce_i, nonce_r));
    out
}

/// Initiator: checks the responder's CHALLENGE and returns the PROOF to send.
pub fn answer(key: &[u8], nonce_i: &Nonce, msg: &[u8; CHALLENGE_LEN]) -> Result<[u8; PROOF_LEN], AuthError> {
    if msg[..8] != MAGIC {
        return Err(AuthError::NotVnet);
    }
    let nonce_r: Nonce = msg[8..40].try_into().expect("32 bytes");
    let expect = mac(key, RESPONDER, nonce_i, &nonce_r);
    if !bool::from(expect.ct_eq(&msg[40..])) {
        return Err(AuthError::BadKey);
    }
    Ok(mac(key, INITIATOR, nonce_i, &nonce_r))
}

/// Responder: checks the initiator's PROOF.
pub fn verify_proof(key: &[u8], nonce_i: &Nonce, nonce_r: &Nonce, proof: &[u8; PROOF_LEN]) -> Result<(), AuthError> {
    let expect = mac(key, INITIATOR, nonce_i, nonce_r);
    if bool::from(expect.ct_eq(proof)) {
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
        let got_ni = read_hello(&hello(&ni)).unwrap();
        assert_eq!(got_ni, ni);
        let ch = challenge(K, &got_ni, &nr);
        let proof = answer(K, &ni, &ch).unwrap();
        assert_eq!(verify_proof(K, &ni, &nr, &proof), Ok(()));
    }

    #[test]
    fn a_responder_without_the_key_is_refused() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = challenge(b"another key of enough length....", &ni, &nr);
        assert_eq!(answer(K, &ni, &ch), Err(AuthError::BadKey));
    }

    #[test]
    fn an_initiator_without_the_key_is_refused() {
        let (ni, nr) = ([1u8; 32], [2u8; 32]);
        let ch = challenge(K, &ni, &nr);
        let forged = answer(b"another key of enough length....", &ni, &challenge(b"another key of enough length....", &ni, &nr)).unwrap();
        assert_eq!(verify_proof(K, &ni, &nr, &forged), Err(AuthError::BadKey));
        // Reflecting the responder's own MAC back does not pass either.
        let reflected: [u8; 32] = ch[40..].try_into().unwrap();
        assert_eq!(verify_proof(K, &ni, &nr, &reflected), Err(AuthError::BadKey));
    }

    #[test]
    fn a_proof_from_another_connection_is_refused() {
        let ni = [1u8; 32];
        let proof = answer(K, &ni, &challenge(K, &ni, &[2u8; 32])).unwrap();
        // Same initiator nonce, but the responder chose a new one.
        assert_eq!(verify_proof(K, &ni, &[3u8; 32], &proof), Err(AuthError::BadKey));
    }

    #[test]
    fn other_protocols_are_told_apart() {
        let mut h = hello(&[0u8; 32]);
        h[..8].copy_from_slice(b"GET / HT");
        assert_eq!(read_hello(&h), Err(AuthError::NotVnet));
        let mut ch = challenge(K, &[0u8; 32], &[0u8; 32]);
        ch[7] = b'2';
        assert_eq!(answer(K, &[0u8; 32], &ch), Err(AuthError::NotVnet));
    }

    #[test]
    fn every_bit_of_the_mac_counts() {
        let (ni, nr) = ([7u8; 32], [9u8; 32]);
        let ch = challenge(K, &ni, &nr);
        for byte in 40..CHALLENGE_LEN {
            let mut bad = ch;
            bad[byte] ^= 0x01;
            assert_eq!(answer(K, &ni, &bad), Err(AuthError::BadKey), "byte {byte}");
        }
    }
}
