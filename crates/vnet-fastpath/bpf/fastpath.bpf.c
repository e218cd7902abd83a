// SPDX-License-Identifier: (GPL-2.0-only OR MIT)
//
// VNET's kernel fast path: three TC programs (attached with TCX) that carry
// the frames vnetd's route cache has already decided, and hand every other
// frame to vnetd (the slow path) with its origin known.
//
//   from_guest    ingress of a guest port's host side (the host end of a
//                 veth whose other end is the guest's NIC, or the TAP QEMU
//                 writes into). An ARP request or IPv6 neighbour
//                 solicitation for an address `neigh` (`neigh6`) binds
//                 for this port, from a guest whose own address it
//                 binds, is answered back into the port (vnet-core's neigh
//                 rule, decided by vnetd per port). A hit is delivered to a local guest or
//                 encapsulated in the link's outer IPv4/UDP header (the
//                 VNET/P wire: outer header, then the whole frame) and sent
//                 out of the underlay device. A miss goes, unchanged, to the
//                 port's upcall TAP, whose file side vnetd reads.
//   from_network  ingress of an underlay device. UDP to vnetd's port from a
//                 known link address, addressed to this host (its MAC, and
//                 the address this host sends the link's datagrams from),
//                 with no UDP checksum or one the device or this kernel
//                 vouches for, whose inner frame hits is decapsulated and
//                 delivered; everything else goes up the host stack as if
//                 this program were not there (vnetd's UDP socket gets what
//                 is VNET's, and the stack judges the rest).
//   from_vnetd    ingress of an upcall TAP: a frame vnetd wrote for the
//                 guest is passed to the guest port.
//
// The maps are the only interface with vnetd. vnetd installs the `flows`
// entries from its rule table (never learned here) and removes the ones a
// control change alters before it replies. Every frame a program takes is
// counted (`counters`, per CPU); every frame it gives up is counted by
// reason (`stats`) and then counted once more by the slow path that takes it.
//
// Programs, maps and attachments are pinned (bpffs, one folder per vnetd), so
// they outlive the vnetd that loaded them: frames it decided keep flowing
// while it restarts, and the next vnetd adopts the maps and replaces the
// programs through the pinned links. Whatever changes the meaning of a map
// bumps LAYOUT (src/pin.rs): a vnetd never adopts maps of another layout.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef PACKET_HOST
#define PACKET_HOST 0 // skb->pkt_type of a frame to this host's MAC
#endif

// ---- shared with vnetd (crates/vnet-fastpath/src/lib.rs: same layout) ----

// A port in a flow key or a counter: an interface id, or a link id with
// LINK_BIT set.
#define LINK_BIT 0x80000000u

struct flow_key {
	__u32 origin;
	__u8 dst[6];
	__u8 src[6];
};

enum action_kind {
	ACT_PEER = 1, // bpf_redirect_peer into a veth guest (ifindex: host end)
	ACT_DEV = 2,  // bpf_redirect to a device's egress (a QEMU TAP)
	ACT_ENCAP = 3, // encapsulate for link `link`
};

struct flow_action {
	__u32 kind;
	__u32 ifindex;
	__u32 link;
	__u32 dest;  // port counted as the frame's destination
	__u32 route; // route id counted as the rule that carried it
	__u32 max_len; // longest unsegmented frame the destination takes (0: any)
};

struct link_info {
	__u8 hdr[28];   // outer IPv4 + UDP header; lengths and checksums zero
	__u32 ip_sum;   // ones' complement sum of hdr's IPv4 words (16-bit folded)
	__u32 mtu;      // largest outer IPv4 packet
	__u32 ifindex;  // underlay device toward the peer
	__u32 saddr;    // network order, as in hdr
	__u32 daddr;
};

// The next hop of a link's datagrams, as the neighbour table knows it:
// vnetd keeps it (crates/vnetd/src/fast/next_hops.rs), for the links whose
// neighbour entry is usable. With it, encap writes the outer Ethernet header
// and sends straight out of the device; without it (not resolved yet, or
// gone), bpf_redirect_neigh routes and resolves as the stack would.
struct next_hop {
	__u8 dst[6];     // the next hop's MAC
	__u8 src[6];     // the underlay device's own MAC
	__u32 ifindex;   // the device it was resolved on (must be the link's)
	__u32 daddr;     // the peer it was resolved for (must be the link's)
};

struct addr_key {
	__u32 addr; // network order
	__u16 port; // network order
	__u16 _pad;
};

// A link's peer, as `link_addrs` finds it by the peer's address and port.
struct link_addr {
	__u32 link;
	__u32 local; // the address this host sends the link's datagrams from
		     // (network order): the one its datagrams must be sent to
};

struct port_info {
	__u32 origin; // this port's id (from_guest) or the guest port to pass to (from_vnetd)
	__u32 ifindex; // from_guest: its upcall TAP; from_vnetd: the guest port's device
	__u32 peer;    // from_vnetd: the guest port is a veth (redirect into its peer)
	__u32 _pad;
};

struct config {
	__u32 enabled; // 0: every frame takes the slow path (SET datapath user)
	__u16 port;    // vnetd's UDP port, network order
	__u8 finish_mac[6]; // MAC of the finishing pair's receiving end
	__u32 finish_ifindex; // its sending end (0: none)
	__u32 finish_recv;    // its receiving end
};

// C_LINK_RESOLVED: a link's frames sent with the kernel resolving the next
// hop (bpf_redirect_neigh: vnetd did not know it yet). Added after layout 1.
// C_NEIGH: ARP requests and neighbour solicitations a port's guest sent
// that were answered here (added after layout 1).
enum counter_kind { C_IFACE_IN = 1, C_IFACE_OUT, C_LINK_IN, C_LINK_OUT, C_ROUTE, C_LINK_RESOLVED, C_NEIGH };

struct counter_key {
	__u32 kind;
	__u32 id;
};

struct counter {
	__u64 frames;
	__u64 bytes;
};

// Indexes of `stats` (per CPU): what the programs did with frames.
enum stat {
	S_HIT_GUEST,    // from a guest, carried by the fast path
	S_HIT_NET,      // from a link, carried by the fast path
	S_MISS_GUEST,   // from a guest, no entry: to vnetd
	S_MISS_NET,     // VNET datagram, no entry: up the stack to vnetd
	S_FROM_VNETD,   // written by vnetd for a guest
	S_SLOW_BIG,     // hit, but too big for the link (or the guest) unsegmented: to vnetd
	S_SLOW_NOT_IP,  // hit, not IP, and too long (or no finishing pair) to go round the pair: to vnetd
	S_SLOW_ROUTE,   // hit, but the link is not (or no longer) described to the kernel: to vnetd
	S_SLOW_GSO,     // GSO the fast path cannot take as is: to vnetd
	S_DROP_ENCAP,   // the kernel refused to encapsulate: dropped
	S_DROP_DECAP,   // the kernel refused to decapsulate: dropped
	S_DROP_NO_PORT, // from_vnetd with no guest port known: dropped
	S_DISABLED,     // fast path off: every frame to vnetd
	S_FINISH,       // datagram for vnetd still unsegmented or with a partial
	                // inner checksum: sent round the finishing pair first
	S_NOT_FOR_US,   // datagram to vnetd's port in a frame for another MAC
	                // (or broadcast, multicast), or from a link's peer to
	                // another address than the link's own: up the stack
	S_SLOW_CSUM,    // UDP checksum set but not verified by the device: up
	                // the stack, which verifies it (and drops a bad one)
	S_MAX,
};

// Least recently used entries make room for new ones: a flood of made-up
// MACs cannot pin the map full; an evicted flow's next frame is a miss and
// vnetd installs it again.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct flow_key);
	__type(value, struct flow_action);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct link_info);
} links SEC(".maps");

// Added after layout 1: a folder without it is adopted and it is made
// (src/lib.rs ADDED_MAPS).
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); // link id
	__type(value, struct next_hop);
} next_hops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct addr_key);
	__type(value, struct link_addr);
} link_addrs SEC(".maps");

// The IPv4 addresses a port's guest may be answered for, and the MAC each
// is answered with (crates/vnetd/src/fast/neigh.rs): vnetd puts here only
// what vnet-core's rule lets it answer (the guest's rules reach that MAC),
// and the guest's own addresses (bound to its own MAC), without which
// nothing is answered here: a guest vnetd has not heard yet goes to vnetd,
// which learns it. Added after layout 1 (src/lib.rs ADDED_MAPS).
struct neigh_key {
	__u32 origin; // the port's interface id
	__u32 addr;   // network order
};

struct neigh_val {
	__u8 mac[6];
	__u16 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct neigh_key);
	__type(value, struct neigh_val);
} neigh SEC(".maps");

// The same for IPv6: a port's neighbour solicitations answered here, for
// the addresses vnetd put in (its guest's own among them, without which
// nothing is answered). Added after `neigh` (src/lib.rs ADDED_MAPS).
struct neigh6_key {
	__u32 origin; // the port's interface id
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct neigh6_key);
	__type(value, struct neigh_val);
} neigh6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32); // ingress ifindex
	__type(value, struct port_info);
} ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct counter_key);
	__type(value, struct counter);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, S_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

// Not read by the programs: vnetd's own records, kept with the maps so that
// they live exactly as long as the pins (crates/vnet-fastpath/src/pin.rs).
// `meta` says which layout the maps have (and which network namespace they
// describe); `ids` keeps the ids vnetd gave its objects, by a hash of each
// object's name, so that a vnetd started again gives them the same ids.
struct meta {
	__u32 magic;
	__u32 layout;
	__u64 netns; // inode of the network namespace the ifindexes are of
	__u32 next[3]; // next id to give: interfaces, links, routes
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct meta);
} meta SEC(".maps");

struct id_key {
	__u32 kind;
	__u32 _pad;
	__u64 hash;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct id_key);
	__type(value, __u32);
} ids SEC(".maps");

// ---- the kernel's view of an skb, for its GSO type (CO-RE) ----

struct sk_buff {
	unsigned char *head;
	unsigned int end;
	__u8 ip_summed : 2;
} __attribute__((preserve_access_index));

struct skb_shared_info {
	unsigned int gso_type;
} __attribute__((preserve_access_index));

extern void *bpf_cast_to_kern_ctx(void *) __ksym;
extern void *bpf_rdonly_cast(const void *, __u32) __ksym;

// Newer than Debian's UAPI headers (Linux 6.3).
#define ADJ_ROOM_DECAP_L3_IPV6 (1ULL << 8)

// The kernel's own values (an anonymous enum in skbuff.h, so CO-RE cannot
// name it): 1 << 16 is SKB_GSO_UDP (UFO's, still in the enum), UDP_L4 is
// 1 << 17. With 16 here the checks below never fired: a guest's UDP GSO
// reached bpf_skb_adjust_room, whose refusal alone sent it to vnetd, and
// trains from the network went uncounted. tests/test_fastpath.py checks
// these against the running kernel's BTF.
#define SKB_GSO_UDP_TUNNEL (1u << 10)
#define SKB_GSO_UDP_TUNNEL_CSUM (1u << 11)
#define SKB_GSO_UDP_L4 (1u << 17)

#define CHECKSUM_UNNECESSARY 1
#define CHECKSUM_PARTIAL 3

static __always_inline unsigned int ip_summed(struct __sk_buff *skb)
{
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	return BPF_CORE_READ_BITFIELD(k, ip_summed);
}

static __always_inline int csum_partial(struct __sk_buff *skb)
{
	return ip_summed(skb) == CHECKSUM_PARTIAL;
}

static __always_inline unsigned int gso_type(struct __sk_buff *skb)
{
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	struct skb_shared_info *sh =
		bpf_rdonly_cast(k->head + k->end, bpf_core_type_id_kernel(struct skb_shared_info));
	return sh->gso_type;
}

// ---- helpers ----

static __always_inline void stat(__u32 i)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &i);
	if (v)
		*v += 1;
}

static __always_inline void count(__u32 kind, __u32 id, __u32 bytes)
{
	struct counter_key k = { .kind = kind, .id = id };
	struct counter *c = bpf_map_lookup_elem(&counters, &k);
	if (!c) {
		struct counter zero = {};
		bpf_map_update_elem(&counters, &k, &zero, BPF_NOEXIST);
		c = bpf_map_lookup_elem(&counters, &k);
		if (!c)
			return;
	}
	c->frames += 1;
	c->bytes += bytes;
}

static __always_inline void count_port(__u32 port, int in, __u32 bytes)
{
	if (port & LINK_BIT)
		count(in ? C_LINK_IN : C_LINK_OUT, port & ~LINK_BIT, bytes);
	else
		count(in ? C_IFACE_IN : C_IFACE_OUT, port, bytes);
}

static __always_inline int enabled(void)
{
	__u32 zero = 0;
	struct config *c = bpf_map_lookup_elem(&config, &zero);
	return c && c->enabled;
}

static __always_inline __u16 fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

// Counts a frame the fast path carried: in on its origin, out on its
// destination, on the route that sent it, and under `what`.
static __always_inline void count_hit(__u32 origin, const struct flow_action *a, __u32 len, __u32 what)
{
	count_port(origin, 1, len);
	count_port(a->dest, 0, len);
	count(C_ROUTE, a->route, len);
	stat(what);
}

// Hands a frame from a guest to vnetd through the port's upcall TAP.
static __always_inline int upcall(struct port_info *p, __u32 why)
{
	stat(why);
	return bpf_redirect(p->ifindex, 0);
}

// "Not for me": the next program on the device (another vnetd's, say)
// sees it, and after the last one the stack does (TCX_NEXT; cls_bpf's
// "continue" for a classic TC filter).
#define PASS TC_ACT_UNSPEC

#define OUTER (sizeof(struct iphdr) + sizeof(struct udphdr) + ETH_HLEN) // 42

// skb->mark of a datagram encap_other sends round the finishing pair (a
// veth in one namespace keeps the mark).
#define SEND_MARK 0x564e0001u

// The outer IPv4 + UDP header of link `l` for an inner frame of `len`
// bytes (lengths and the IPv4 checksum filled in).
static __always_inline void outer_header(__u8 hdr[28], const struct link_info *l, __u32 len)
{
	__builtin_memcpy(hdr, l->hdr, 28);
	__u32 ip_len = len + OUTER - ETH_HLEN;
	__u16 tot = ip_len > 0xffff ? 0xffff : ip_len; // GSO segments get their own
	struct iphdr *ip = (void *)hdr;
	struct udphdr *udp = (void *)(hdr + sizeof(struct iphdr));
	ip->tot_len = bpf_htons(tot);
	ip->check = fold(l->ip_sum + bpf_htons(tot));
	udp->len = bpf_htons(tot - sizeof(struct iphdr));
}

// Sends a datagram of link `id` (its outer IPv4 header in place after an
// Ethernet header) toward the peer: to the next hop vnetd keeps from the
// neighbour table (the Ethernet header written here, no route or neighbour
// lookup), or, while vnetd does not know it, by bpf_redirect_neigh, which
// routes the packet (it must leave by the link's device) and fills in the
// next hop's header, resolving the neighbour if need be (counted). No
// forwarding setting is needed on the host, as bpf_fib_lookup would want.
static __always_inline int to_peer(struct __sk_buff *skb, __u32 id, const struct link_info *l)
{
	struct next_hop *nh = bpf_map_lookup_elem(&next_hops, &id);
	if (nh && nh->ifindex == l->ifindex && nh->daddr == l->daddr) {
		struct ethhdr outer = { .h_proto = bpf_htons(ETH_P_IP) };
		__builtin_memcpy(outer.h_dest, nh->dst, ETH_ALEN);
		__builtin_memcpy(outer.h_source, nh->src, ETH_ALEN);
		if (bpf_skb_store_bytes(skb, 0, &outer, ETH_HLEN, 0)) {
			stat(S_DROP_ENCAP);
			return TC_ACT_SHOT;
		}
		return bpf_redirect(l->ifindex, 0);
	}
	count(C_LINK_RESOLVED, id, skb->len);
	return bpf_redirect_neigh(l->ifindex, 0, 0, 0);
}

// A frame that is not IP (ARP, mostly) for a link. bpf_skb_adjust_room
// encapsulates IP only, and bpf_redirect_neigh sends IP only (both go by
// skb->protocol, which a program cannot set). So the outer headers are
// pushed in front (bpf_skb_change_head), with an Ethernet header to the
// finishing pair's receiving end, and the frame is sent round the pair:
// there the kernel reads it again as the IPv4 datagram it now is, and
// from_network, seeing the mark, sends it on to the link's device. Without
// this a guest's ARP toward another host would need vnetd, and a guest
// whose neighbour entry expires while vnetd is away would lose its flows.
static __always_inline int encap_other(struct __sk_buff *skb, struct port_info *p, struct flow_action *a,
				       const struct link_info *l, const struct ethhdr *inner_eth)
{
	__u32 zero = 0;
	struct config *c = bpf_map_lookup_elem(&config, &zero);
	__u32 len = skb->len;
	if (!c || !c->finish_ifindex || skb->gso_size || len + OUTER - ETH_HLEN > l->mtu)
		return upcall(p, S_SLOW_NOT_IP);
	if (bpf_skb_change_head(skb, OUTER, 0))
		return upcall(p, S_SLOW_NOT_IP);
	struct ethhdr outer = { .h_proto = bpf_htons(ETH_P_IP) };
	__builtin_memcpy(outer.h_dest, c->finish_mac, ETH_ALEN);
	__builtin_memcpy(outer.h_source, c->finish_mac, ETH_ALEN);
	__u8 hdr[28];
	outer_header(hdr, l, len);
	if (bpf_skb_store_bytes(skb, 0, &outer, ETH_HLEN, 0) || bpf_skb_store_bytes(skb, ETH_HLEN, hdr, 28, 0)) {
		stat(S_DROP_ENCAP);
		return TC_ACT_SHOT;
	}
	skb->mark = SEND_MARK;
	count_hit(p->origin, a, len, S_HIT_GUEST);
	return bpf_redirect(c->finish_ifindex, 0);
}

// Sends a datagram from the network round the finishing pair, whose
// sending end has no offloads: the kernel segments it and finishes its
// checksums, and its datagrams come back on the other end, one frame each
// (`finish`).
static __always_inline int round_the_pair(struct __sk_buff *skb, const struct config *c)
{
	stat(S_FINISH);
	if (bpf_skb_store_bytes(skb, 0, c->finish_mac, ETH_ALEN, 0))
		return PASS;
	skb->mark = 0; // not one of encap_other's
	return bpf_redirect(c->finish_ifindex, 0);
}

// Encapsulates the frame for link `a->link` and sends it toward the peer;
// a frame the fast path cannot send as it is goes to vnetd instead.
static __always_inline int encap(struct __sk_buff *skb, struct port_info *p, struct flow_action *a,
				 const struct ethhdr *inner_eth)
{
	struct link_info *l = bpf_map_lookup_elem(&links, &a->link);
	if (!l)
		return upcall(p, S_SLOW_ROUTE);
	if (inner_eth->h_proto != bpf_htons(ETH_P_IP) && inner_eth->h_proto != bpf_htons(ETH_P_IPV6))
		return encap_other(skb, p, a, l, inner_eth);
	__u32 len = skb->len; // the whole inner frame
	if (skb->gso_size) {
		// A guest's UDP GSO cannot have its segment size changed.
		if (gso_type(skb) & SKB_GSO_UDP_L4)
			return upcall(p, S_SLOW_GSO);
	} else if (len + OUTER - ETH_HLEN > l->mtu) {
		return upcall(p, S_SLOW_BIG);
	}

	// Room for outer IPv4 + UDP + the inner Ethernet header, after the
	// Ethernet header the frame has now (which becomes the outer one). A
	// super-frame's segment size shrinks by the same 42 bytes, so every
	// segment, encapsulated, is as long as the guest made it.
	__u64 flags = BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_ENCAP_L2_ETH |
		      BPF_F_ADJ_ROOM_ENCAP_L2(ETH_HLEN);
	if (bpf_skb_adjust_room(skb, OUTER, BPF_ADJ_ROOM_MAC, flags))
		return upcall(p, S_SLOW_GSO); // the kernel would not: unchanged, so vnetd can

	// inner_eth is the caller's copy: the packet has moved.
	if (bpf_skb_store_bytes(skb, ETH_HLEN + 28, inner_eth, ETH_HLEN, 0))
		goto shot;
	__u8 hdr[28];
	outer_header(hdr, l, len);
	if (bpf_skb_store_bytes(skb, ETH_HLEN, hdr, 28, 0))
		goto shot;
	int verdict = to_peer(skb, a->link, l);
	if (verdict != TC_ACT_SHOT)
		count_hit(p->origin, a, len, S_HIT_GUEST);
	return verdict;
shot:
	stat(S_DROP_ENCAP);
	return TC_ACT_SHOT;
}

#define ARP_LEN 42 // Ethernet + ARP for IPv4

// The guest's ARP request, answered here if `neigh` says so for its port:
// the reply is written over the request and sent back out of the port
// (TC_ACT_REDIRECT); -1 if not (the caller goes on as for any frame).
static __always_inline int arp_answer(struct __sk_buff *skb, struct port_info *p)
{
	if (skb->len < ARP_LEN || bpf_skb_pull_data(skb, ARP_LEN))
		return -1;
	__u8 *d = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	if (d + ARP_LEN > end)
		return -1;
	// htype 1, ptype IPv4, hlen 6, plen 4, op 1 (request); the sender is
	// the frame's source.
	static const __u8 want[8] = { 0, 1, 8, 0, 6, 4, 0, 1 };
	for (int i = 0; i < 8; i++)
		if (d[14 + i] != want[i])
			return -1;
	for (int i = 0; i < 6; i++)
		if (d[22 + i] != d[6 + i])
			return -1;
	struct neigh_key k = { .origin = p->origin };
	__builtin_memcpy(&k.addr, d + 28, 4);
	__u32 spa = k.addr, tpa;
	__builtin_memcpy(&tpa, d + 38, 4);
	if (spa == tpa)
		return -1; // a gratuitous ARP asks nothing
	struct neigh_val *own = bpf_map_lookup_elem(&neigh, &k);
	if (!own)
		return -1;
	for (int i = 0; i < 6; i++)
		if (own->mac[i] != d[6 + i])
			return -1;
	k.addr = tpa;
	struct neigh_val *h = bpf_map_lookup_elem(&neigh, &k);
	if (!h)
		return -1;
	__u8 asker[6], holder[6];
	__builtin_memcpy(asker, d + 6, 6);
	__builtin_memcpy(holder, h->mac, 6);
	int same = 1;
	for (int i = 0; i < 6; i++)
		if (holder[i] != asker[i])
			same = 0;
	if (same)
		return -1;
	__u8 r[ARP_LEN];
	__builtin_memcpy(r, asker, 6);          // to the asker
	__builtin_memcpy(r + 6, holder, 6);     // from the holder
	__builtin_memcpy(r + 12, d + 12, 2);    // ARP
	__builtin_memcpy(r + 14, want, 6);
	r[20] = 0;
	r[21] = 2;                              // reply
	__builtin_memcpy(r + 22, holder, 6);    // sender: the holder, the target address
	__builtin_memcpy(r + 28, &tpa, 4);
	__builtin_memcpy(r + 32, asker, 6);     // target: the asker
	__builtin_memcpy(r + 38, &spa, 4);
	if (bpf_skb_store_bytes(skb, 0, r, ARP_LEN, 0))
		return -1;
	count(C_NEIGH, p->origin, skb->len);
	return bpf_redirect(skb->ifindex, 0);
}

// A neighbour solicitation as Linux and every stack send one to a
// solicited-node group: Ethernet, IPv6 (no extension header), ICMPv6 135
// with the target and one option, the source's link-layer address.
#define ND_LEN (ETH_HLEN + 40 + 32)
#define IPV6_NEXTHDR_ICMP 58

// The ones' complement sum of ICMPv6 message `icmp` (32 bytes) under its
// pseudo-header (`ip6` points at the IPv6 source, then destination):
// 0xffff when its checksum is right; to be inverted and written when the
// checksum field is 0.
static __always_inline __u16 nd_sum(const __u8 *src, const __u8 *dst, const __u8 *icmp)
{
	__u8 b[72];
	__builtin_memcpy(b, src, 16);
	__builtin_memcpy(b + 16, dst, 16);
	__u32 len = bpf_htonl(32), nh = bpf_htonl(IPV6_NEXTHDR_ICMP);
	__builtin_memcpy(b + 32, &len, 4);
	__builtin_memcpy(b + 36, &nh, 4);
	__builtin_memcpy(b + 40, icmp, 32);
	__s64 s = bpf_csum_diff(0, 0, (void *)b, sizeof(b), 0);
	if (s < 0)
		return 0;
	__u32 c = (__u32)s;
	c = (c & 0xffff) + (c >> 16);
	c = (c & 0xffff) + (c >> 16);
	return (__u16)c;
}

// The guest's neighbour solicitation, answered here if `neigh6` says so for
// its port (vnet-core's rule, as for ARP): a solicited advertisement with
// the holder's link-layer address, written over the request and sent back
// out of the port; -1 if not. What vnet-core would not answer is not
// answered here either: a solicitation from :: (DAD), one whose checksum
// is wrong, whose hop limit is not 255, or whose link-layer option is not
// the frame's source. Other shapes (extension headers, more options) go to
// vnetd, which reads them whole.
static __always_inline int nd_answer(struct __sk_buff *skb, struct port_info *p)
{
	if (skb->len != ND_LEN || bpf_skb_pull_data(skb, ND_LEN))
		return -1;
	__u8 *d = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	if (d + ND_LEN > end)
		return -1;
	__u8 *ip6 = d + ETH_HLEN, *icmp = ip6 + 40;
	// Version 6, payload 32, ICMPv6, hop limit 255; a solicitation, code
	// 0; one option of 8 bytes: the source link-layer address, the
	// frame's source.
	if ((ip6[0] >> 4) != 6 || ip6[4] != 0 || ip6[5] != 32 || ip6[6] != IPV6_NEXTHDR_ICMP || ip6[7] != 255)
		return -1;
	if (icmp[0] != 135 || icmp[1] != 0 || icmp[24] != 1 || icmp[25] != 1)
		return -1;
	for (int i = 0; i < 6; i++)
		if (icmp[26 + i] != d[6 + i])
			return -1;
	if (nd_sum(ip6 + 8, ip6 + 24, icmp) != 0xffff)
		return -1;
	struct neigh6_key k = { .origin = p->origin };
	__builtin_memcpy(k.addr, ip6 + 8, 16);
	struct neigh_val *own = bpf_map_lookup_elem(&neigh6, &k);
	if (!own) // the asker's own address unknown (:: among them): vnetd
		return -1;
	for (int i = 0; i < 6; i++)
		if (own->mac[i] != d[6 + i])
			return -1;
	__u8 asker_ip[16], target[16];
	__builtin_memcpy(asker_ip, ip6 + 8, 16);
	__builtin_memcpy(target, icmp + 8, 16);
	__builtin_memcpy(k.addr, target, 16);
	struct neigh_val *h = bpf_map_lookup_elem(&neigh6, &k);
	if (!h)
		return -1;
	__u8 asker[6], holder[6];
	__builtin_memcpy(asker, d + 6, 6);
	__builtin_memcpy(holder, h->mac, 6);
	int same = 1;
	for (int i = 0; i < 6; i++)
		if (holder[i] != asker[i])
			same = 0;
	if (same)
		return -1;
	__u8 r[ND_LEN] = {};
	__builtin_memcpy(r, asker, 6);          // to the asker
	__builtin_memcpy(r + 6, holder, 6);     // from the holder
	r[12] = 0x86;
	r[13] = 0xdd;
	__u8 *rip = r + ETH_HLEN, *ricmp = rip + 40;
	rip[0] = 0x60;
	rip[5] = 32;
	rip[6] = IPV6_NEXTHDR_ICMP;
	rip[7] = 255;
	__builtin_memcpy(rip + 8, target, 16);    // from the target address
	__builtin_memcpy(rip + 24, asker_ip, 16); // to the asker's
	ricmp[0] = 136;                           // an advertisement,
	ricmp[4] = 0x60;                          // solicited, override
	__builtin_memcpy(ricmp + 8, target, 16);
	ricmp[24] = 2;                            // the target's link-layer address
	ricmp[25] = 1;
	__builtin_memcpy(ricmp + 26, holder, 6);
	__u16 sum = ~nd_sum(rip + 8, rip + 24, ricmp);
	__builtin_memcpy(ricmp + 2, &sum, 2);
	if (bpf_skb_store_bytes(skb, 0, r, ND_LEN, 0))
		return -1;
	count(C_NEIGH, p->origin, skb->len);
	return bpf_redirect(skb->ifindex, 0);
}

SEC("tc")
int from_guest(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct port_info *p = bpf_map_lookup_elem(&ports, &ifindex);
	if (!p)
		return TC_ACT_SHOT; // attached to a port vnetd has not described: never happens
	if (!enabled())
		return upcall(p, S_DISABLED);

	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end) {
		// Headers not in the linear part (rare): let vnetd read it.
		if (skb->len < ETH_HLEN || bpf_skb_pull_data(skb, ETH_HLEN))
			return upcall(p, S_MISS_GUEST);
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		eth = data;
		if ((void *)(eth + 1) > end)
			return upcall(p, S_MISS_GUEST);
	}
	if ((eth->h_dest[0] & 1) && (eth->h_proto == bpf_htons(ETH_P_ARP) || eth->h_proto == bpf_htons(ETH_P_IPV6))) {
		int r = eth->h_proto == bpf_htons(ETH_P_ARP) ? arp_answer(skb, p) : nd_answer(skb, p);
		if (r >= 0)
			return r;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		eth = data;
		if ((void *)(eth + 1) > end)
			return upcall(p, S_MISS_GUEST);
	}
	struct flow_key key = { .origin = p->origin };
	__builtin_memcpy(key.dst, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(key.src, eth->h_source, ETH_ALEN);
	struct flow_action *a = bpf_map_lookup_elem(&flows, &key);
	if (!a)
		return upcall(p, S_MISS_GUEST);

	if (a->kind == ACT_ENCAP) {
		struct ethhdr copy = *eth;
		return encap(skb, p, a, &copy);
	}
	__u32 len = skb->len;
	if (a->max_len && !skb->gso_size && len > a->max_len)
		return upcall(p, S_SLOW_BIG); // vnetd drops it and counts it (oversize)
	count_hit(p->origin, a, len, S_HIT_GUEST);
	if (a->kind == ACT_PEER)
		return bpf_redirect_peer(a->ifindex, 0);
	return bpf_redirect(a->ifindex, 0);
}

SEC("tc")
int from_network(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->version != 4 || ip->protocol != IPPROTO_UDP)
		return PASS;
	if (ip->frag_off & bpf_htons(0x3fff)) // a fragment: the stack reassembles it
		return PASS;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return PASS;
	__u32 zero = 0;
	struct config *c = bpf_map_lookup_elem(&config, &zero);
	if (!c)
		return PASS;
	struct ethhdr *inner = (void *)(udp + 1);
	if ((void *)(inner + 1) > end) {
		// A train from a veth underlay (a peer's UDP GSO, unsegmented)
		// keeps only its outer headers in the skb's head: for vnetd's
		// port, the inner Ethernet header is pulled in so that the train
		// can be judged (other traffic is left as it came).
		if (udp->dest != c->port || bpf_skb_pull_data(skb, OUTER + ETH_HLEN))
			return PASS;
		data = (void *)(long)skb->data;
		end = (void *)(long)skb->data_end;
		ip = data + ETH_HLEN;
		udp = (void *)(ip + 1);
		inner = (void *)(udp + 1);
		if ((void *)(inner + 1) > end)
			return PASS; // a datagram too short to hold a frame: vnetd counts it
	}
	if (skb->mark == SEND_MARK && skb->ifindex == c->finish_recv) {
		// encap_other's datagram, back from the finishing pair as IPv4:
		// on to the link's device, the next hop's header filled in.
		skb->mark = 0;
		struct addr_key to = { .addr = ip->daddr, .port = udp->dest };
		struct link_addr *la = bpf_map_lookup_elem(&link_addrs, &to);
		struct link_info *l = la ? bpf_map_lookup_elem(&links, &la->link) : 0;
		if (!l) {
			stat(S_DROP_ENCAP);
			return TC_ACT_SHOT;
		}
		return to_peer(skb, la->link, l);
	}
	if (udp->dest != c->port)
		return PASS;
	// What the socket path takes, the stack has taken first: a frame to
	// this host's MAC (not one the device saw for another host, nor a
	// broadcast or multicast), to an address of this host.
	if (skb->pkt_type != PACKET_HOST) {
		stat(S_NOT_FOR_US); // the stack drops another host's, judges a broadcast
		return PASS;
	}
	struct addr_key ak = { .addr = ip->saddr, .port = udp->source };
	struct link_addr *la = bpf_map_lookup_elem(&link_addrs, &ak);
	if (!la)
		return PASS; // vnetd counts datagrams from strangers
	if (ip->daddr != la->local) {
		// Not to the address this host sends the link's datagrams from:
		// the stack gives vnetd's socket what is addressed to this host
		// (another of its addresses, when the socket binds them all),
		// and drops or forwards the rest, as without this program.
		stat(S_NOT_FOR_US);
		return PASS;
	}
	if (fold(bpf_csum_diff(0, 0, (void *)ip, sizeof(*ip), 0)) != 0)
		return PASS; // corrupt: the stack drops it and counts it
	// A UDP checksum (vnetd's socket sends one; the fast path does not) is
	// taken only as vouched for: checked by the device, not yet computed
	// (sent by this machine's kernel over a veth), or computed by this
	// kernel on the finishing pair. Any other (no receive checksum offload,
	// or a device that leaves the sum to the stack) goes up the stack,
	// which verifies it: the datagram was sent by the peer's vnetd, on
	// its slow path, anyway.
	if (udp->check && skb->ifindex != c->finish_recv) {
		unsigned int summed = ip_summed(skb);
		if (summed != CHECKSUM_UNNECESSARY && summed != CHECKSUM_PARTIAL) {
			stat(S_SLOW_CSUM);
			return PASS;
		}
	}

	struct flow_key key = { .origin = la->link | LINK_BIT };
	__builtin_memcpy(key.dst, inner->h_dest, ETH_ALEN);
	__builtin_memcpy(key.src, inner->h_source, ETH_ALEN);
	struct flow_action *a = 0;
	if (c->enabled)
		a = bpf_map_lookup_elem(&flows, &key);
	else
		stat(S_DISABLED);
	if (a && a->kind == ACT_ENCAP)
		a = 0; // link to link: vnetd relays it
	unsigned int gso = skb->gso_size ? gso_type(skb) : 0;
	if (gso & SKB_GSO_UDP_L4) {
		// A train of datagrams (a peer vnetd's UDP GSO, which a veth
		// underlay delivers unsegmented). Its first frame's route stands
		// for the rest: to a guest of this host, the train goes round the
		// finishing pair, which cuts it into its datagrams, and each comes
		// back here on its own (one whose route differs is judged as
		// itself). Otherwise vnetd reads the train as it is.
		if (a && c->finish_ifindex)
			return round_the_pair(skb, c);
		stat(S_SLOW_GSO);
		return PASS;
	}
	// What a veth passes between namespaces is not what a wire carries: a
	// fast-path sender's packet may still be one unsegmented super-frame
	// (UDP-tunnel GSO), or carry its inner checksum unfinished. A veth guest
	// takes both as they are. Anything else (vnetd, a QEMU TAP) is first
	// sent round the finishing pair, whose sending end has no offloads, so
	// the kernel segments it and finishes the checksums, as a NIC would;
	// the datagrams come back on the other end, one frame each.
	if ((!a || a->kind != ACT_PEER) && (gso || csum_partial(skb)) && c->finish_ifindex)
		return round_the_pair(skb, c);
	if (!a) {
		if (c->enabled)
			stat(S_MISS_NET);
		return PASS;
	}
	if (!gso && (bpf_ntohs(ip->tot_len) + ETH_HLEN != skb->len ||
		     bpf_ntohs(udp->len) + sizeof(*ip) != bpf_ntohs(ip->tot_len)))
		return PASS; // lengths that do not add up: the stack judges it
	if (!gso && a->max_len && skb->len - OUTER > a->max_len) {
		stat(S_SLOW_BIG); // too big for the guest: vnetd drops it and counts it
		return PASS;
	}
	struct ethhdr eth_in = *inner;
	__u32 len = skb->len - OUTER;
	// Straight into a veth guest's namespace (bpf_redirect_peer) when the
	// frame is IP: the skb's protocol, set from the outer header, is made
	// the frame's (IPv6: BPF_F_ADJ_ROOM_DECAP_L3_IPV6). Any other frame
	// (ARP) leaves by the veth's host end, whose peer reads its header
	// again; such frames are never super-frames. So does a single TCP
	// segment (a VM's stream, cut into segments by its host, or a peer's
	// train cut round the finishing pair): the host end's transmit feeds
	// the guest end's NAPI, where the guest's kernel merges the stream's
	// segments (GRO on, the host end without TSO: vnetd's nic/veth.rs), as
	// a NIC's driver does. Other single frames (UDP, which merges only for
	// a socket that asks) keep the shorter way.
	// (A datagram cut from a train may hold only headers up to the inner
	// Ethernet one in its head: the protocol is loaded, not pointed at.)
	__u8 proto = 0;
	if (!gso && a->kind == ACT_PEER) {
		if (eth_in.h_proto == bpf_htons(ETH_P_IP))
			bpf_skb_load_bytes(skb, OUTER + ETH_HLEN + offsetof(struct iphdr, protocol), &proto, 1);
		else if (eth_in.h_proto == bpf_htons(ETH_P_IPV6))
			bpf_skb_load_bytes(skb, OUTER + ETH_HLEN + 6, &proto, 1); // nexthdr
	}
	int peer = a->kind == ACT_PEER && proto != IPPROTO_TCP;
	__u64 dflags = BPF_F_ADJ_ROOM_FIXED_GSO;
	if (eth_in.h_proto == bpf_htons(ETH_P_IPV6))
		dflags |= ADJ_ROOM_DECAP_L3_IPV6;
	else if (eth_in.h_proto != bpf_htons(ETH_P_IP))
		peer = 0;
	if (gso && !peer) {
		stat(S_SLOW_GSO);
		return PASS;
	}
	if (bpf_skb_adjust_room(skb, -(__s32)OUTER, BPF_ADJ_ROOM_MAC, dflags) ||
	    bpf_skb_store_bytes(skb, 0, &eth_in, ETH_HLEN, 0)) {
		stat(S_DROP_DECAP);
		return TC_ACT_SHOT;
	}
	count_hit(key.origin, a, len, S_HIT_NET);
	if (peer)
		return bpf_redirect_peer(a->ifindex, 0);
	return bpf_redirect(a->ifindex, 0);
}

SEC("tc")
int from_vnetd(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct port_info *p = bpf_map_lookup_elem(&ports, &ifindex);
	if (!p) {
		stat(S_DROP_NO_PORT);
		return TC_ACT_SHOT;
	}
	stat(S_FROM_VNETD);
	if (p->peer)
		return bpf_redirect_peer(p->ifindex, 0);
	return bpf_redirect(p->ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
