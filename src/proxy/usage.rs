//! The engine's own report of what it had cached, read from each answer to a prompt and
//! checked against the record's prediction when the answer ends.

use bytes::Bytes;

use super::ctx::RequestCtx;
use super::lb::PrefixLb;
use crate::routing::Usage;

impl PrefixLb {
    /// Starts reading the usage of a successful answer to a priced request, or to any request
    /// whose span reports it.
    pub(crate) fn watch_usage(&self, ctx: &mut RequestCtx, status: u16) {
        let priced = ctx.slot.as_ref().is_some_and(|s| s.priced());
        let wanted = priced || ctx.trace.is_some();
        ctx.usage = (wanted && (200..300).contains(&status)).then(Box::default);
    }

    pub(crate) fn read_usage(&self, ctx: &mut RequestCtx, chunk: Option<&Bytes>) {
        if let (Some(reader), Some(chunk)) = (ctx.usage.as_mut(), chunk) {
            reader.feed(chunk);
        }
    }

    /// Hands the answer's usage, if it gave one, to the slot; when the engine had evicted
    /// what the record said it held, the record forgets it there. Returns the usage, for the
    /// request's span.
    pub(crate) fn settle_usage(&self, ctx: &mut RequestCtx) -> Option<Usage> {
        let usage = ctx.usage.take()?.usage()?;
        let Some(slot) = ctx.slot.as_mut() else {
            return Some(usage);
        };
        let margin = self.router.balance.cost.tuning.eviction_margin;
        if let Some(held) = slot.report(usage, margin) {
            let serial = slot.peer().serial();
            self.router
                .cluster()
                .record()
                .evicted(&ctx.demand.blocks, serial, held);
        }
        Some(usage)
    }
}
