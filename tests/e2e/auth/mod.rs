//! Authentication, roles and TLS (issue 16, ADR 0009), against the real
//! binaries started with credentials (`FERRY_INSECURE=false`):
//!
//! - [`rpcs`]: every RPC the servers list by reflection refuses a call
//!   without a credential; the role matrix of every RPC; an agent acts only
//!   as itself and for its own bridges;
//! - [`mtls`]: client certificates from another CA, and agent certificates
//!   that name another id, are refused;
//! - [`reload`]: the token file is reloaded while the server runs;
//! - [`support`]: the processes, token files, certificates and raw calls.

mod mtls;
mod reload;
mod rpcs;
pub(crate) mod support;
