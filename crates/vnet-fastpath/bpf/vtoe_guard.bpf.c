// SPDX-License-Identifier: (GPL-2.0-only OR MIT)
//
// VTOE's guard: what keeps a shadow connection handed to a guest program
// (a host-namespace TCP socket, see docs/vtoe.md) from giving the guest any
// reach it does not have on the overlay. vnetd seals each shadow socket
// before it hands it over: it writes the connection's two pairs of ends, the
// overlay's (guest IPs and ports) and the host's (the shadow connection's),
// into the socket's own storage (`sealed`). From then on, whoever holds the
// socket:
//
//   cgroup/connect4,6     refuses connect() (EPERM): the socket is never
//                         re-aimed, at a host address or anywhere else
//   cgroup/bind4,6        refuses bind() (EPERM): no host port
//   cgroup_skb/egress     drops every packet the socket would send, and
//   cgroup_skb/ingress    every packet for it, that is not of the sealed
//                         host connection: after a disconnect
//                         (connect(AF_UNSPEC), which no cgroup hook sees) the
//                         socket can neither reach anything else nor be
//                         reached through a listen() on a host port
//   cgroup/setsockopt     refuses the options that would tie it to a host
//                         device or report host addresses (SO_BINDTODEVICE,
//                         SO_BINDTOIFINDEX, IP_PKTINFO)
//   cgroup/getpeername4,  report the overlay's addresses, as accept() does
//   cgroup/getsockname4   too, never the host's
//
// These are cgroup (v2) programs: they run for sockets created in the cgroup
// they are attached to, vnetd's, which shadow sockets are (accepted ones
// inherit their listener's). Every refusal and drop is counted (`counters`).
// What a cgroup hook cannot see (interface ioctls, which list the host's
// devices and addresses) is in docs/vtoe.md.

#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ETH_P_IP 0x0800
#define SOL_SOCKET 1
#define SO_BINDTODEVICE 25
#define SO_BINDTOIFINDEX 62
#define SOL_IP 0
#define IP_PKTINFO 8

// ---- shared with vnetd (crates/vnet-fastpath/src/guard.rs: same layout) ----

// A sealed socket's ends; addresses and ports in network order.
struct seal {
	__u32 overlay_local_ip;
	__u32 overlay_peer_ip;
	__u16 overlay_local_port;
	__u16 overlay_peer_port;
	__u32 host_local_ip;
	__u32 host_peer_ip;
	__u16 host_local_port;
	__u16 host_peer_port;
};

enum counter {
	C_CONNECT = 0,  // connect() refused
	C_BIND = 1,     // bind() refused
	C_SOCKOPT = 2,  // setsockopt() refused
	C_DROP_OUT = 3, // packet sent not of the sealed connection, dropped
	C_DROP_IN = 4,  // packet received not of the sealed connection, dropped
	C_PEERNAME = 5, // getpeername() answered with the overlay's address
	C_SOCKNAME = 6, // getsockname() answered with the overlay's address
	C_MAX = 7,
};

// ---- end of the shared part ----

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct seal);
} sealed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, C_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	if (v)
		*v += 1;
}

static __always_inline struct seal *seal_of(struct bpf_sock *sk)
{
	if (!sk)
		return 0;
	return bpf_sk_storage_get(&sealed, sk, 0, 0);
}

// connect() and bind(): 0 refuses (EPERM), 1 lets the call go on.
static __always_inline int refuse_sealed(struct bpf_sock_addr *ctx, __u32 which)
{
	if (seal_of(ctx->sk)) {
		count(which);
		return 0;
	}
	return 1;
}

SEC("cgroup/connect4")
int vtoe_connect4(struct bpf_sock_addr *ctx)
{
	return refuse_sealed(ctx, C_CONNECT);
}

SEC("cgroup/connect6")
int vtoe_connect6(struct bpf_sock_addr *ctx)
{
	return refuse_sealed(ctx, C_CONNECT);
}

SEC("cgroup/bind4")
int vtoe_bind4(struct bpf_sock_addr *ctx)
{
	return refuse_sealed(ctx, C_BIND);
}

SEC("cgroup/bind6")
int vtoe_bind6(struct bpf_sock_addr *ctx)
{
	return refuse_sealed(ctx, C_BIND);
}

static __always_inline int rewrite(struct bpf_sock_addr *ctx, int peer)
{
	struct seal *s = seal_of(ctx->sk);
	if (!s)
		return 1;
	if (peer) {
		ctx->user_ip4 = s->overlay_peer_ip;
		ctx->user_port = s->overlay_peer_port;
		count(C_PEERNAME);
	} else {
		ctx->user_ip4 = s->overlay_local_ip;
		ctx->user_port = s->overlay_local_port;
		count(C_SOCKNAME);
	}
	return 1;
}

SEC("cgroup/getpeername4")
int vtoe_getpeername4(struct bpf_sock_addr *ctx)
{
	return rewrite(ctx, 1);
}

SEC("cgroup/getsockname4")
int vtoe_getsockname4(struct bpf_sock_addr *ctx)
{
	return rewrite(ctx, 0);
}

// Whether an IPv4 TCP packet (skb data at its IP header) is of the sealed
// host connection, in the direction given.
static __always_inline int of_connection(struct __sk_buff *skb, struct seal *s, int out)
{
	struct iphdr ip;
	struct tcphdr tcp;
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 0;
	if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0 || ip.protocol != IPPROTO_TCP)
		return 0;
	if (bpf_skb_load_bytes(skb, ip.ihl * 4, &tcp, sizeof(tcp)) < 0)
		return 0;
	if (out)
		return ip.saddr == s->host_local_ip && ip.daddr == s->host_peer_ip &&
		       tcp.source == s->host_local_port && tcp.dest == s->host_peer_port;
	return ip.saddr == s->host_peer_ip && ip.daddr == s->host_local_ip &&
	       tcp.source == s->host_peer_port && tcp.dest == s->host_local_port;
}

// cgroup_skb: 1 passes the packet, 0 drops it.
static __always_inline int filter(struct __sk_buff *skb, int out)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 1;
	sk = bpf_sk_fullsock(sk);
	struct seal *s = seal_of(sk);
	if (!s || of_connection(skb, s, out))
		return 1;
	count(out ? C_DROP_OUT : C_DROP_IN);
	return 0;
}

SEC("cgroup_skb/egress")
int vtoe_egress(struct __sk_buff *skb)
{
	return filter(skb, 1);
}

SEC("cgroup_skb/ingress")
int vtoe_ingress(struct __sk_buff *skb)
{
	return filter(skb, 0);
}

SEC("cgroup/setsockopt")
int vtoe_setsockopt(struct bpf_sockopt *ctx)
{
	int bad = (ctx->level == SOL_SOCKET && (ctx->optname == SO_BINDTODEVICE || ctx->optname == SO_BINDTOIFINDEX)) ||
		  (ctx->level == SOL_IP && ctx->optname == IP_PKTINFO);
	if (bad && seal_of(ctx->sk)) {
		count(C_SOCKOPT);
		return 0;
	}
	// Leave the kernel's own handling (and the option's value) as it was.
	return 1;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
