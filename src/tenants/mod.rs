//! API keys and what each may spend: who a request is from, and whether its tenant has room.
//!
//! Keys are kept as SHA-256 digests, so the file is not a list of secrets. A key is looked up by
//! the digest of what the client presented: finding a digest in a map tells an attacker nothing
//! about the key behind another digest. Limits are per key: requests in flight at once, and
//! optionally a rate of requests and of prompt bytes, as token buckets that may go into debt by
//! one request (a prompt larger than a second's allowance is still served, and the wait it
//! costs falls on the tenant's next request).
//!
//! `limits` is what a key may spend, `admission` whether a tenant has room now, `keys` the keys
//! in force and who a request is from.

mod admission;
mod keys;
mod limits;

pub use admission::{Tenant, TenantSlot};
pub use keys::{AuthFailure, ClientAuth, Tenants};
pub use limits::{Limits, OverLimit};
