//! What VTOE parses from outside vnetd: a runner's messages (any process in
//! a guest may send them) and a peer's shadow-handshake messages. For any
//! bytes:
//! - `ToVnetd::decode` / `FromVnetd::decode` never panic, and whatever they
//!   accept is canonical: encoding it gives back exactly the input;
//! - `Request::decode` accepts only version 1 with reserved bytes zero, and
//!   round-trips;
//! - a REQUEST or VERDICT message that is not the one the key's holder
//!   made for these nonces is refused (the input's bytes are tried as
//!   someone without the key would send them, and with one byte of a
//!   genuine message flipped).
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::linkauth::{self, VTOE};
use vnet_core::vtoe::{self, FromVnetd, Request, ToVnetd, REQUEST_LEN, REQUEST_MSG_LEN, VERDICT_MSG_LEN};

const KEY: &[u8] = b"the fuzz target's link key......";

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = ToVnetd::decode(data) {
        assert_eq!(m.encode(), data, "{m:?}");
    }
    if let Ok(m) = FromVnetd::decode(data) {
        assert_eq!(m.encode(), data, "{m:?}");
    }
    if let Ok(b) = <[u8; REQUEST_LEN]>::try_from(data.get(..REQUEST_LEN).unwrap_or(&[])) {
        if let Ok(r) = Request::decode(&b) {
            assert_eq!(r.encode(), b);
        }
    }
    let (ni, nr) = ([3u8; 32], [4u8; 32]);
    // Bytes from someone without the key.
    if let Ok(msg) = <[u8; REQUEST_MSG_LEN]>::try_from(data.get(..REQUEST_MSG_LEN).unwrap_or(&[])) {
        assert!(vtoe::read_request(KEY, &ni, &nr, &msg).is_err());
    }
    // A genuine request and verdict, one byte flipped where the input says.
    let Some((&at, rest)) = data.split_first() else { return };
    let mut b = [0u8; REQUEST_LEN];
    b[0] = 1;
    for (i, x) in rest.iter().take(24).enumerate() {
        b[2 + i] = *x;
    }
    let Ok(req) = Request::decode(&b) else { return };
    let ch = linkauth::challenge(&VTOE, KEY, &ni, &nr);
    let (_, mut msg) = vtoe::request_msg(KEY, &ni, &ch, &req).expect("our own challenge");
    assert_eq!(vtoe::read_request(KEY, &ni, &nr, &msg), Ok(req));
    msg[at as usize % REQUEST_MSG_LEN] ^= 0x01;
    assert!(vtoe::read_request(KEY, &ni, &nr, &msg).is_err());
    let mut v = vtoe::verdict_msg(KEY, &ni, &nr, &req, Ok(()));
    assert_eq!(vtoe::read_verdict(KEY, &ni, &nr, &req, &v), Ok(Ok(())));
    v[at as usize % VERDICT_MSG_LEN] ^= 0x80;
    assert!(vtoe::read_verdict(KEY, &ni, &nr, &req, &v).is_err());
});
