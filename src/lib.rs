//! prefixlb: a load balancer for LLM inference clusters that routes each prompt to the GPU that
//! already holds its prefix in KV cache, and overflows to the next one when that GPU is full.

pub mod access_log;
pub mod admin;
pub mod config;
pub mod control;
pub mod error;
pub mod lifecycle;
pub mod metrics;
pub mod proxy;
pub mod router;
pub mod routing;
pub mod server;
pub mod settings;
pub mod tenants;
pub mod tls;
pub mod traces;
