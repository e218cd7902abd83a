//! Which receive queue a frame for the guest goes to: a hash of its flow
//! (IPv4 or IPv6 addresses, and TCP or UDP ports when the packet carries
//! them whole), so that one flow's frames always reach the guest on one
//! queue, in order, while different flows spread over the queue pairs the
//! guest runs. Frames that are not IP hash by their MAC addresses.
//!
//! Reads only the frame vnetd holds (its own buffer or the copy of a
//! guest's headers), never guest memory, and any bytes at all: a short or
//! malformed header hashes what is there.

/// The flow hash of an Ethernet frame.
pub fn flow_hash(frame: &[u8]) -> u32 {
    let mut h = Mix::default();
    let Some(&[t0, t1]) = frame.get(12..14) else {
        h.add(frame.get(..12).unwrap_or(frame));
        return h.finish();
    };
    let (mut ty, mut l3) = (u16::from_be_bytes([t0, t1]), 14);
    // One 802.1Q or 802.1ad tag.
    if matches!(ty, 0x8100 | 0x88a8) {
        match frame.get(16..18) {
            Some(&[a, b]) => (ty, l3) = (u16::from_be_bytes([a, b]), 18),
            _ => ty = 0,
        }
    }
    let ip = &frame[l3.min(frame.len())..];
    let (proto, l4) = match ty {
        0x0800 if ip.len() >= 20 => {
            h.add(&ip[12..20]);
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            // A fragment (offset or more-fragments set) has no ports of its
            // own to hash: all of a datagram's fragments hash alike.
            let fragment = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0;
            (if fragment { 0 } else { ip[9] }, ihl)
        }
        0x86dd if ip.len() >= 40 => {
            h.add(&ip[8..40]);
            (ip[6], 40)
        }
        _ => {
            h.add(&frame[..12]);
            return h.finish();
        }
    };
    if matches!(proto, 6 | 17) {
        if let Some(ports) = ip.get(l4..l4 + 4) {
            h.add(ports);
        }
    }
    h.finish()
}

/// A small multiply-and-rotate hash (no keys: the guest chooses its flows,
/// and all a skewed choice gets it is its own flows on fewer queues).
#[derive(Default)]
struct Mix(u64);

impl Mix {
    fn add(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.0 = (self.0 ^ u64::from_le_bytes(w)).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        }
    }

    fn finish(&self) -> u32 {
        let x = self.0 ^ (self.0 >> 32);
        (x.wrapping_mul(0xff51_afd7_ed55_8ccd) >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn udp4(src_port: u16, dst_port: u16, frag: u16) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 8];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[14 + 6..14 + 8].copy_from_slice(&frag.to_be_bytes());
        f[14 + 9] = 17;
        f[14 + 12..14 + 20].copy_from_slice(&[198, 19, 0, 1, 198, 19, 0, 2]);
        f[34..36].copy_from_slice(&src_port.to_be_bytes());
        f[36..38].copy_from_slice(&dst_port.to_be_bytes());
        f
    }

    #[test]
    fn one_flow_hashes_alike_and_flows_spread_over_four_queues() {
        let a = udp4(40000, 5201, 0);
        let mut b = a.clone();
        b.extend_from_slice(b"payload differs");
        assert_eq!(flow_hash(&a), flow_hash(&b), "a flow's frames go to one queue whatever they carry");
        let mut per = [0u32; 4];
        for port in 40000..40400 {
            per[(flow_hash(&udp4(port, 5201, 0)) % 4) as usize] += 1;
        }
        assert!(per.iter().all(|&n| (60..=140).contains(&n)), "400 flows over 4 queues: {per:?}");
    }

    #[test]
    fn fragments_hash_by_addresses_and_any_bytes_are_taken() {
        // A datagram's first fragment (more-fragments) and a later one hash
        // alike, whatever their "ports".
        assert_eq!(flow_hash(&udp4(1, 2, 0x2000)), flow_hash(&udp4(3, 4, 0x0010)));
        let f = udp4(1, 2, 0);
        for n in 0..=f.len() {
            let _ = flow_hash(&f[..n]);
        }
        let _ = flow_hash(&[0x81, 0x00]);
        let mut tagged = vec![0u8; 16];
        tagged[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
        let _ = flow_hash(&tagged);
    }
}
