//! The cluster every run is on, the simulator models it runs, the seeds, and what the routers
//! are told of it.

/// Requests each simulated GPU runs at once; more wait in its queue. The simulator's figure:
/// prefixlb is not told it.
pub const MAX_RUNNING: usize = 8;
pub const CACHE_TOKENS: usize = 65_536;
/// Divides every simulated duration. At 4 a full run takes about an hour on two cores; the
/// bench process, the routers and the simulators together stay under one core's worth of CPU
/// (checked with `time` on single rows), so the CPU does not set the times.
pub const SPEED: f64 = 6.0;
/// The simulator's prefill rate at speed 1 (gpu-sim's default). Only the floor reads it:
/// prefixlb learns its own rate from what it sees, or keeps its default.
pub const SIM_PREFILL_TOKENS_PER_SEC: f64 = 10_000.0;
pub const MAX_IN_FLIGHT: u32 = 32;
pub const REPLICAS: usize = 4;
pub const SESSION_HEADER: &str = "x-session-id";
/// gpu-sim serves SGLang's `/v1/loads`, which SMG polls.
pub const ENGINE_LOADS: bool = true;
/// The model the simulated GPUs serve and every request names: SMG sends a request only to
/// a worker serving the model it names.
pub const MODEL_NAME: &str = "sim-llama-3-8b";

/// The seeds prefixlb's constants are tuned on (`cargo bench --bench cluster -- tuning`): the
/// first is the one every figure before issue 28 was chosen on. No verdict reads them.
pub const TUNING_SEEDS: [u64; 3] = [20261201, 20261202, 20261203];
/// The seeds the verdicts read, never used for tuning.
pub const VERDICT_SEEDS: [u64; 3] = [20270101, 20270102, 20270103];

/// How the simulated GPUs schedule their work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimModel {
    /// gpu-sim's first model: one FIFO prefill lane, 4 characters a token, equal GPUs.
    Lane,
    /// Chunked prefill sharing steps with decodes, KV memory held by running requests with
    /// preemption, 3 ms a request, 3.3 characters a token, and the last GPU at half pace.
    Engine,
}

pub const MODELS: [SimModel; 2] = [SimModel::Lane, SimModel::Engine];

impl SimModel {
    pub fn name(self) -> &'static str {
        match self {
            SimModel::Lane => "lane",
            SimModel::Engine => "engine",
        }
    }

    /// gpu-sim's command line for `gpus` GPUs of this model.
    pub fn sim_args(self, gpus: usize) -> Vec<String> {
        let mut args = vec![
            format!("--speed={SPEED}"),
            format!("--cache-tokens={CACHE_TOKENS}"),
            format!("--max-running={MAX_RUNNING}"),
            format!("--prefill-tokens-per-sec={SIM_PREFILL_TOKENS_PER_SEC}"),
            format!("--sim-model={}", self.name()),
            format!("--model={MODEL_NAME}"),
        ];
        if self == SimModel::Engine {
            let paces: Vec<&str> = (0..gpus)
                .map(|g| if g + 1 == gpus { "0.5" } else { "1" })
                .collect();
            args.push(format!("--pace={}", paces.join(",")));
        }
        args
    }

    /// Prompt characters the fastest GPU prefills a millisecond, at [`SPEED`].
    pub fn chars_per_ms(self) -> f64 {
        let chars_per_token = match self {
            SimModel::Lane => 4.0,
            SimModel::Engine => 3.3,
        };
        SIM_PREFILL_TOKENS_PER_SEC * SPEED * chars_per_token / 1000.0
    }
}
