//! The vsock packet header a guest writes (vnet_vhost::vsock::packet). For
//! any bytes and any payload room: `Header::parse` never panics; what it
//! accepts names the guest's own CID as source and the host as destination,
//! carries a length only on RW and never past the room, and encodes back to
//! exactly the bytes parsed.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_vhost::vsock::packet::{Header, Op, HDR_LEN, HOST_CID};

const CID: u64 = 7;

fuzz_target!(|data: &[u8]| {
    let room = data.first().map_or(0, |&b| usize::from(b) * 17);
    let bytes = data.get(1..).unwrap_or(&[]);
    if let Ok(h) = Header::parse(bytes, CID, room) {
        assert_eq!((h.src_cid, h.dst_cid), (CID, HOST_CID), "{h:?}");
        assert!(h.len as usize <= room && (h.op == Op::Rw || h.len == 0), "{h:?}");
        assert_eq!(&h.encode()[..], &bytes[..HDR_LEN], "{h:?}");
    }
});
