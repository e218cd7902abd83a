//! Which receive queue a frame for a multi-queue guest goes to
//! (`vnet_vhost::steer::flow_hash`), on any bytes: no panic, and the hash
//! depends on the headers alone: a byte past the deepest header it may
//! read (an 802.1Q tag, a 60-byte IPv4 header with options, the ports:
//! 18 + 60 + 4 bytes) never changes it, so a flow's frames, whatever they
//! carry, reach the guest on one queue.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vnet_vhost::steer::flow_hash;

const HEADERS: usize = 18 + 60 + 4;

fuzz_target!(|data: &[u8]| {
    let h = flow_hash(data);
    assert_eq!(h, flow_hash(data), "the same frame, another hash");
    if data.len() > HEADERS {
        let mut changed = data.to_vec();
        for b in &mut changed[HEADERS..] {
            *b = !*b;
        }
        changed.extend_from_slice(b"more payload");
        assert_eq!(h, flow_hash(&changed), "a payload byte changed the flow's hash");
    }
});
