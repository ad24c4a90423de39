//! The upstream side: pooled clients and header hygiene ([`client`]), the call of a protected
//! request and what its ending means ([`call`]), and requests streamed straight through
//! ([`passthrough`]).

pub mod call;
pub mod client;
pub mod passthrough;

pub use call::{describe, Called, PrefixedBody};
pub use client::{
    default_roots, full, request_headers, shared_roots, strip_hop_by_hop, BoundedConnect, BoxError,
    ProxyBody, UpstreamClient,
};
pub use passthrough::{passthrough, Target};
