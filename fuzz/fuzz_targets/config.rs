//! The configuration parser on any text: an error or settings, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefixlb::config::schema::{self, peers};

fuzz_target!(|text: &str| {
    // A peer named by host would be resolved: keep the fuzzer off the resolver.
    let resolves = |peers: &[peers::Peer]| {
        peers
            .iter()
            .any(|p| p.addr.parse::<std::net::SocketAddr>().is_err())
    };
    if let Ok(file) = serde_yaml::from_str::<schema::File>(text) {
        if resolves(&file.peers) {
            return;
        }
    }
    if let Ok(file) = serde_yaml::from_str::<peers::PeersFile>(text) {
        if resolves(&file.peers) {
            return;
        }
    }
    let _ = prefixlb::config::parse(text);
    let _ = prefixlb::config::parse_peers_file(text);
});
