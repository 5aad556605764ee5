//! prefixlb's routing settings: the policy and its tuning, what is peeked at for a key, and
//! where spans go.

use serde_yaml::Value;

use super::TestConfig;

impl TestConfig {
    // Routing.

    pub fn policy(self, name: &str) -> Self {
        self.set(&["routing", "policy"], name)
    }

    /// `None` lifts the bound (null).
    pub fn balance_factor(self, factor: Option<f64>) -> Self {
        self.set(
            &["routing", "balance_factor"],
            factor.map_or(Value::Null, Value::from),
        )
    }

    pub fn prefill_tokens_per_second(self, rate: f64) -> Self {
        self.set(&["routing", "prefill_tokens_per_second"], rate)
    }

    pub fn shared_prefix_placement(self, on: bool) -> Self {
        self.set(&["routing", "shared_prefix_placement"], on)
    }

    /// `advanced.<key>`: one figure of the tuning, written as YAML.
    pub fn advanced(self, key: &str, yaml: &str) -> Self {
        self.yaml(&["advanced", key], yaml)
    }

    /// `<section>.<key>`, written as YAML: what a bench sweeps without a method of its own.
    pub fn yaml(self, path: &[&str], yaml: &str) -> Self {
        let value: Value = serde_yaml::from_str(yaml).expect("a YAML value");
        self.set(path, value)
    }

    pub fn prefix_record_mib(self, mib: u64) -> Self {
        self.set(&["routing", "prefix_record_mib"], mib)
    }

    pub fn peek_limit_bytes(self, bytes: u64) -> Self {
        self.set(&["routing", "peek_limit_bytes"], bytes)
    }

    pub fn peek_timeout_ms(self, ms: u64) -> Self {
        self.set(&["routing", "peek_timeout_ms"], ms)
    }

    pub fn chat_path(self, path: &str) -> Self {
        self.set(&["routing", "key", "chat_path"], path)
    }

    /// `tracing`: spans sent to the OTLP/HTTP traces URL `endpoint`, as `service_name`.
    pub fn tracing(self, endpoint: &str, service_name: &str) -> Self {
        self.set(&["tracing", "otlp_endpoint"], endpoint)
            .set(&["tracing", "service_name"], service_name)
    }
}
