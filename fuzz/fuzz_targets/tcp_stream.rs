//! A TCP link's byte stream through the stateful reader, `TcpFramer`, as the
//! dispatcher drives it (`drain_tcp`: compact, read into `spare()`,
//! `filled`, take every complete frame). The input chooses the frames
//! (lengths 14..=MAX_TCP_FRAME, the edges often), sometimes one bad length
//! prefix among them, the reader's batch size, and how the stream is cut
//! into reads. Checked after every read:
//! - the frames come back in order, byte for byte, each as soon as its last
//!   byte is in (never waiting for the next read), and nothing else does;
//! - `pending()` is exactly the bytes of the frame still arriving;
//! - `spare()` is never empty after `compact()`;
//! - a bad length is reported as soon as its 4 bytes are in, after exactly
//!   the frames before it, with its value; nothing after it is returned;
//! - a complete stream ends with `pending() == 0`; after `reset()` (a new
//!   connection) the frames come through again, cut differently.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vnet_core::wire::{tcp_frame_len, BadLength, TcpFramer, MAX_TCP_FRAME};

/// Input bytes, read in order; zeros once they run out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
}

/// Frame lengths at and near the edges.
const EDGES: [usize; 16] =
    [14, 15, 16, 17, 18, 60, 64, 100, 1500, 1514, 1518, 4096, 9018, MAX_TCP_FRAME - 2, MAX_TCP_FRAME - 1, MAX_TCP_FRAME];

fn frame_len(a: u8, b: u8) -> usize {
    let n = match a {
        0..=15 => EDGES[a as usize],
        // Mostly short frames, so that an input runs fast...
        16..=223 => 14 + (a as usize - 16) * 8 + (b as usize & 7),
        // ... and sometimes one of up to 64 KiB.
        _ => 14 + ((a as usize - 224) << 11 | (b as usize) << 3),
    };
    n.min(MAX_TCP_FRAME)
}

/// A read size: mostly small, sometimes large, sometimes all the room there is.
fn read_size(b: u8) -> usize {
    let v = (b & 63) as usize;
    match b >> 6 {
        0 => v + 1,
        1 => v * 67 + 1,
        2 => v * 1031 + 1,
        _ => usize::MAX,
    }
}

struct Bad {
    /// How many frames come before it.
    at: usize,
    value: u32,
}

/// Feeds `stream` to `f` in reads of the given sizes (cycled), and checks
/// every property above. `frames` are what the stream carries, `bad` the bad
/// prefix among them, if any.
fn feed(f: &mut TcpFramer, frames: &[Vec<u8>], bad: Option<&Bad>, reads: &[usize]) {
    // Where each frame (with its prefix) ends in the stream, and where the
    // bad prefix starts.
    let mut stream = Vec::new();
    let mut ends = Vec::new();
    let mut bad_at = None;
    for (i, fr) in frames.iter().enumerate() {
        if let Some(b) = bad.filter(|b| b.at == i) {
            bad_at = Some(stream.len());
            stream.extend_from_slice(&b.value.to_be_bytes());
        }
        stream.extend_from_slice(&(fr.len() as u32).to_be_bytes());
        stream.extend_from_slice(fr);
        ends.push(stream.len());
    }
    if let Some(b) = bad.filter(|b| b.at == frames.len()) {
        bad_at = Some(stream.len());
        stream.extend_from_slice(&b.value.to_be_bytes());
    }
    // Only the frames before the bad prefix can come back.
    let good = bad.map_or(frames.len(), |b| b.at);

    // Reads of at least 1/16384 of the stream, to keep a megabyte stream
    // fast; small streams are still cut at every byte.
    let least = (stream.len() >> 14).max(1);
    let (mut fed, mut got, mut i) = (0, 0, 0);
    let mut reported = None;
    while fed < stream.len() {
        f.compact();
        let spare = f.spare();
        assert!(!spare.is_empty(), "no room to read into after compact(), {} bytes pending", f.pending());
        let n = reads[i % reads.len()].max(least).min(spare.len()).min(stream.len() - fed);
        i += 1;
        spare[..n].copy_from_slice(&stream[fed..fed + n]);
        f.filled(n);
        fed += n;
        while let Some(next) = f.next_frame() {
            match next {
                Ok(r) => {
                    assert!(got < good, "frame returned after the last one before the bad length");
                    assert!(r.end <= f.buf().len());
                    assert_eq!(r.len(), frames[got].len(), "frame {got}: wrong length");
                    assert!(f.buf()[r] == frames[got][..], "frame {got}: wrong bytes");
                    got += 1;
                }
                Err(BadLength(v)) => {
                    let b = bad.expect("a bad length reported in a stream without one");
                    assert_eq!(v, b.value);
                    assert_eq!(got, good, "bad length reported after {got} frames, not {good}");
                    reported = Some(fed);
                    break;
                }
            }
        }
        if reported.is_some() {
            break;
        }
        // Every frame whose last byte is in has come back; nothing waits
        // but the frame (or prefix) still arriving.
        let complete = ends[..good].iter().take_while(|&&e| e <= fed).count();
        assert_eq!(got, complete, "after {fed} bytes: {got} frames, {complete} complete");
        let consumed = if got == 0 { 0 } else { ends[got - 1] };
        let consumed = match bad_at {
            Some(at) if got == good => at.max(consumed),
            _ => consumed,
        };
        assert_eq!(f.pending(), fed - consumed, "after {fed} bytes");
        if let Some(at) = bad_at {
            assert!(fed < at + 4, "bad length not reported once its 4 bytes were in");
        }
    }
    match (bad_at, reported) {
        (Some(at), Some(when)) => {
            assert!(when >= at + 4, "bad length reported before its 4 bytes were in");
        }
        (Some(_), None) => panic!("bad length never reported"),
        (None, _) => {
            assert_eq!(got, frames.len());
            assert_eq!(f.pending(), 0, "a complete stream leaves nothing pending");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Bytes(data);
    let batch = match input.u8() % 6 {
        0 => 1,
        1 => 7,
        2 => 64,
        3 => 1500,
        4 => 65536,
        _ => 256 << 10, // the dispatcher's TCP_READ_BATCH
    };
    let count = (input.u8() % 17) as usize;
    let bad_flags = input.u8();
    let bad_raw = input.u32();
    let mut seed = input.u32() | 1;
    let mut frames = Vec::with_capacity(count);
    for j in 0..count {
        let len = frame_len(input.u8(), input.u8());
        // Contents that differ by position and frame, so that a shifted,
        // truncated or swapped frame never compares equal.
        let frame: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                (seed >> 24) as u8 ^ j as u8
            })
            .collect();
        frames.push(frame);
    }
    let bad = (bad_flags & 1 == 1).then(|| {
        let value = match (bad_flags >> 1) & 3 {
            0 => bad_raw % 14,
            1 => MAX_TCP_FRAME as u32 + 1 + bad_raw % (u32::MAX - MAX_TCP_FRAME as u32),
            2 => u32::MAX,
            _ => bad_raw | 0x8000_0000,
        };
        assert_eq!(tcp_frame_len(value.to_be_bytes()), None, "{value} must be a bad length");
        Bad { at: (bad_flags >> 3) as usize % (count + 1), value }
    });
    let mut reads: Vec<usize> = input.0.iter().map(|&b| read_size(b)).collect();
    if reads.is_empty() {
        reads.push(usize::MAX);
    }

    let mut f = TcpFramer::new(batch);
    feed(&mut f, &frames, bad.as_ref(), &reads);
    // A new connection: the same frames, without the bad length, cut
    // differently.
    f.reset();
    assert_eq!(f.pending(), 0);
    reads.rotate_left(1);
    feed(&mut f, &frames, None, &reads);
});
