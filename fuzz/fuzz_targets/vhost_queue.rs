//! A hostile driver against one vhost-user ring (vnet-vhost's queue): the
//! input is a script of driver actions (descriptors, indirect tables,
//! avail indices, raw bytes anywhere in the rings) between the device's
//! pops and puts, while a second thread keeps rewriting the descriptor
//! table and the buffers, so guest memory changes between the device's own
//! reads. Asserts: no panic; each call reads at most one chain's worth of
//! descriptors (the queue's size, and one look at an indirect head); a
//! pass never reads much more than its budget; a frame taken in place
//! has a head no longer than `MAX_HEAD` and pieces inside guest memory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vnet_core::offload::{VnetHdr, MAX_PIECES};
use vnet_vhost::queue::{Popped, Ring};
use vnet_vhost::{Counters, GuestFrame, GuestMemory, MAX_HEAD};

const MEM: usize = 256 << 10;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x4000;
const USED: u64 = 0x5000;
const BUFS: u64 = 0x8000;

struct Input<'a>(&'a [u8]);
impl Input<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from(self.u8()?) | u16::from(self.u8()?) << 8)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from(self.u16()?) | u32::from(self.u16()?) << 16)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let Some(cfg) = inp.u8() else { return };
    let size = 1u16 << (cfg % 8 + 1); // 2 .. 256
    let event_idx = cfg & 0x80 != 0;
    let mem = GuestMemory::<()>::anonymous(&[(GuestAddress(0), MEM)]);
    let counters = Arc::new(Counters::default());
    let Some(mut ring) = Ring::with_layout(counters, mem.clone(), size, DESC, AVAIL, USED, event_idx) else { return };
    let limit = u32::from(size) + 1;
    let per_pass = ring.budget().descs_per_pass + limit;
    let (lo, hi) = {
        let s = mem.get_slice(GuestAddress(0), MEM).unwrap();
        let p = s.ptr_guard_mut().as_ptr() as usize;
        (p, p + MEM)
    };

    // The second writer: rewrites descriptors and buffers while the device
    // reads them (xorshift from the script's seed).
    let stop = Arc::new(AtomicBool::new(false));
    let seed = u64::from(inp.u32().unwrap_or(1)) | 1;
    let writer = {
        let (mem, stop) = (mem.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut x = seed;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = if x & 1 == 0 { DESC + (x >> 8) % (16 * u64::from(size)) } else { BUFS + (x >> 8) % 0x1000 };
                let _ = mem.write_obj((x >> 32) as u8, GuestAddress(at));
            }
        })
    };

    let mut out = vec![0u8; 70000];
    let mut frame = GuestFrame::default();
    let payload = [0x5au8; 9000];
    while let Some(op) = inp.u8() {
        match op % 9 {
            0 => {
                // A descriptor: anywhere, or inside the buffer area.
                let (i, a, len, flags, next) = (inp.u16().unwrap_or(0), inp.u32().unwrap_or(0), inp.u32().unwrap_or(0), inp.u16().unwrap_or(0), inp.u16().unwrap_or(0));
                let addr = if a & 1 == 0 { BUFS + u64::from(a) % (MEM as u64 - BUFS) } else { u64::from(a) << 8 };
                let mut d = [0u8; 16];
                d[..8].copy_from_slice(&addr.to_le_bytes());
                d[8..12].copy_from_slice(&len.to_le_bytes());
                d[12..14].copy_from_slice(&flags.to_le_bytes());
                d[14..].copy_from_slice(&next.to_le_bytes());
                let _ = mem.write_slice(&d, GuestAddress(DESC + 16 * u64::from(i % size)));
            }
            1 => {
                // Offer heads, as a driver would.
                let n = inp.u8().unwrap_or(0) % 64;
                let idx: u16 = mem.read_obj(GuestAddress(AVAIL + 2)).unwrap_or(0);
                for k in 0..n {
                    let h = inp.u16().unwrap_or(0);
                    let slot = (idx.wrapping_add(u16::from(k)) % size) as u64;
                    let _ = mem.write_obj(h, GuestAddress(AVAIL + 4 + 2 * slot));
                }
                let _ = mem.write_obj(idx.wrapping_add(u16::from(n)), GuestAddress(AVAIL + 2));
            }
            2 => {
                let _ = mem.write_obj(inp.u16().unwrap_or(0), GuestAddress(AVAIL + 2));
            }
            3 | 4 => {
                let before = ring.spent();
                let f = if op % 9 == 3 { Some(&mut frame) } else { None };
                if let Popped::InPlace = ring.pop_frame(&mut out, 12, f) {
                    assert!(frame.head_len() <= MAX_HEAD && frame.head_len() > 0);
                    let mut rest = [&[][..]; MAX_PIECES];
                    let (_, k) = frame.parts(&mut rest);
                    for p in &rest[..k] {
                        let a = p.as_ptr() as usize;
                        assert!(a >= lo && a + p.len() <= hi, "a piece outside guest memory");
                    }
                    frame.release();
                }
                assert!(ring.spent() - before <= limit, "one pop read {} descriptors", ring.spent() - before);
                assert!(ring.spent() <= per_pass);
            }
            5 => {
                let before = ring.spent();
                let n = usize::from(inp.u16().unwrap_or(0)) % payload.len();
                let mergeable = n & 1 == 0;
                let _ = ring.put_frame(&VnetHdr::default(), &[&payload[..n / 2], &payload[n / 2..n]], 12, mergeable);
                // A frame may take up to 64 chains, each within the queue.
                assert!(ring.spent() - before <= 64 * limit);
                assert!(ring.spent() <= per_pass + 64 * limit);
            }
            6 => {
                ring.publish();
                let _ = ring.guest_wants_interrupt();
                let _ = ring.guest_armed();
            }
            7 => {
                let _ = ring.set_kicks(op & 0x10 != 0);
            }
            _ => {
                // Raw bytes anywhere in the rings (flags, used_event, ...).
                let at = u64::from(inp.u16().unwrap_or(0)) % BUFS;
                let b = inp.u8().unwrap_or(0);
                let _ = mem.write_obj(b, GuestAddress(at));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
});
