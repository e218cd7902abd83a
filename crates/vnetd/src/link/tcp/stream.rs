//! What the dispatcher that owns a TCP link reads: the link's event fd and
//! its live connection, framed into a run of frames per read.

use super::conn::{Conn, TcpLink};
use crate::link::{LinkSource, RxCx};
use crate::stats::DropReason;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use vnet_core::wire::TcpFramer;

/// Bytes read from one TCP link per event (then the other sources get a turn).
const READ_BATCH: usize = 256 << 10;

/// What the dispatcher reading a link's connection keeps: the connection it
/// watches and the stream's partial frame.
struct Reading {
    conn: Option<Conn>,
    framer: Option<TcpFramer>,
    /// Watching for the socket to drain (EPOLLOUT).
    want_out: bool,
}

/// A TCP link's connection and event fd, as the dispatcher that owns the
/// link reads them: frames in, and the send buffer written out when the
/// socket drains.
pub struct StreamSource {
    link: Arc<TcpLink>,
    /// The link's id once in a topology (it finds its slot by it).
    pub id: AtomicU32,
    read: Mutex<Reading>,
}

impl StreamSource {
    pub fn new(link: Arc<TcpLink>) -> Arc<StreamSource> {
        let read = Mutex::new(Reading { conn: None, framer: None, want_out: false });
        Arc::new(StreamSource { link, id: AtomicU32::new(u32::MAX), read })
    }
}

impl LinkSource for StreamSource {
    /// Follows the link's live connection (a new one: the partial frame of
    /// the old is dropped) and whether frames wait for the socket.
    fn generation(&self) -> u64 {
        let mut r = self.read.lock().unwrap_or_else(|p| p.into_inner());
        let live = self.link.conn();
        if r.conn.as_ref().map(|c| c.id) != live.as_ref().map(|c| c.id) {
            if let Some(f) = r.framer.as_mut() {
                f.reset();
            }
            r.conn = live;
        }
        r.want_out = r.conn.is_some() && self.link.has_pending();
        r.conn.as_ref().map_or(0, |c| c.id << 1) | r.want_out as u64
    }

    /// The event fd, and the live connection (with EPOLLOUT while frames
    /// wait for it).
    fn watch(&self) -> Vec<(RawFd, u32)> {
        let r = self.read.lock().unwrap_or_else(|p| p.into_inner());
        let mut fds = vec![(self.link.event_fd(), libc::EPOLLIN as u32)];
        if let Some(c) = &r.conn {
            let mut ev = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
            if r.want_out {
                ev |= libc::EPOLLOUT as u32;
            }
            fds.push((c.stream.as_raw_fd(), ev));
        }
        fds
    }

    fn owner(&self, n: usize) -> usize {
        self.id.load(Relaxed) as usize % n.max(1)
    }

    fn ready(&self, i: usize, events: u32, cx: &mut RxCx) -> usize {
        if i == 0 {
            // The connection changed, or frames wait: `watch` sees which.
            self.link.clear_event();
            return 0;
        }
        let Some(slot) = cx.links.slot_of_link(self.id.load(Relaxed)) else { return 0 };
        if events & libc::EPOLLOUT as u32 != 0 {
            let w = self.link.write_out();
            if w.frames > 0 {
                if let Some((_, stats)) = cx.links.link(slot) {
                    cx.st.sent_at(stats, w.frames, w.bytes);
                }
            }
        }
        if events & (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR | libc::EPOLLRDHUP) as u32 != 0 {
            return self.read_frames(slot, cx);
        }
        0
    }
}

impl StreamSource {
    /// Reads what the connection has (up to `READ_BATCH` bytes) and routes
    /// the complete frames as one run; the frames read.
    fn read_frames(&self, slot: u32, cx: &mut RxCx) -> usize {
        let mut r = self.read.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = r.conn.clone() else { return 0 };
        let framer = r.framer.get_or_insert_with(|| TcpFramer::new(READ_BATCH));
        let (mut read, mut frames) = (0, 0);
        let mut ended = false;
        while read < READ_BATCH {
            framer.compact();
            let n = match (&*conn.stream).read(framer.spare()) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::info!(remote = %self.link.remote, "TCP link read failed: {e}");
                    ended = true;
                    break;
                }
            };
            read += n;
            framer.filled(n);
            let mut bad = None;
            while let Some(f) = framer.next_frame() {
                match f {
                    Ok(range) => {
                        frames += 1;
                        cx.intake.link_frame(slot, framer.buf_mut(), range);
                    }
                    Err(b) => {
                        bad = Some(b);
                        break;
                    }
                }
            }
            // The run ends with what this read brought: a complete frame
            // never waits for the next one, nor for another snapshot.
            cx.intake.end_run(framer.buf());
            if let Some(b) = bad {
                // The stream is out of step: nothing after this can be trusted.
                if let Some((_, stats)) = cx.links.link(slot) {
                    cx.st.drop_at(Some(stats), DropReason::Malformed);
                }
                tracing::warn!(remote = %self.link.remote, len = b.0, "bad frame length on TCP link; reconnecting");
                ended = true;
                break;
            }
        }
        if ended {
            self.link.lost(conn.id);
        }
        frames
    }
}
