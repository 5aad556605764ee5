//! The `prefixlb` binary.

use std::process::ExitCode;

// jemalloc, measured against glibc's malloc and mimalloc (`benches/memory.rs`, `overhead.rs`):
// an open stream holds 50 KiB with it, 55 KiB with glibc and 170 KiB with mimalloc, an idle
// connection 29 KiB against 88 KiB with either; per request it costs less CPU than glibc.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    prefixlb::server::main_from(std::env::args_os())
}
