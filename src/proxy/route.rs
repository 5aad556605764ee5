//! The request filter's last step: the pool that serves the request's model, then a peer's
//! slot, at once for a request too light to be bounded, else in the waiting line.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pingora::proxy::Session;

use super::answer::Stop;
use super::client::bounded;
use super::ctx::RequestCtx;
use super::error::ApiError;
use super::gate::Prompt;
use super::lb::PrefixLb;
use crate::metrics;
use crate::routing::{Decision, Peer, PoolChoice, Rejection, Routed};

impl PrefixLb {
    /// Routes the request the gate passed: on success `ctx` holds its slot.
    pub(crate) async fn route(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        pooled: bool,
        prompt: &Prompt,
    ) -> Result<(), Stop> {
        self.choose_pool(ctx, pooled, prompt.model.as_deref())?;
        metrics::KEY_SOURCES
            .with_label_values(&[prompt.key.source.as_str()])
            .inc();
        if let Some(id) = prompt.previous.as_deref() {
            if let Some(routed) = self.home_of(id) {
                ctx.take_slot(routed);
                return Ok(());
            }
            // The response it continues is not known here: its body names only the new
            // input, which no engine holds, while its session's name says where it went.
            if ctx.demand.session {
                ctx.demand.by_key_alone();
            }
        }
        if !bounded(session) {
            return self.route_now(session, ctx).map_err(Stop::from);
        }
        self.wait_in_line(session, ctx).await
    }

    /// Narrows the demand to the pool of the model asked for (or the default one), when the
    /// cluster has pools.
    fn choose_pool(
        &self,
        ctx: &mut RequestCtx,
        pooled: bool,
        model: Option<&str>,
    ) -> Result<(), ApiError> {
        let default = self.settings.default_model.as_deref();
        let pool = match pooled {
            true => self.router.cluster().pools().choose(model, default),
            false => PoolChoice::Any,
        };
        match pool {
            PoolChoice::Any => {}
            PoolChoice::Model(id) => ctx.demand.model = Some(id),
            PoolChoice::Unknown => {
                metrics::REJECTIONS
                    .with_label_values(&["model_not_found"])
                    .inc();
                let name = model.or(default).unwrap_or_default();
                return Err(ApiError::model_not_found(name));
            }
        }
        Ok(())
    }

    /// Takes a slot for an unbounded request, which never waits.
    fn route_now(&self, session: &Session, ctx: &mut RequestCtx) -> Result<(), ApiError> {
        match self.choose_now(session, ctx) {
            Decision::Routed(routed) => {
                ctx.take_slot(routed);
                Ok(())
            }
            _ => {
                metrics::REJECTIONS.with_label_values(&["no_peer"]).inc();
                Err(ApiError::rejected(Rejection::NoPeer))
            }
        }
    }

    /// Chooses the peer for a request that skips the waiting line: a retry after a failed
    /// connect, or a request too light to be bounded.
    pub(crate) fn choose_now(&self, session: &Session, ctx: &RequestCtx) -> Decision {
        let cluster = self.router.cluster();
        if !bounded(session) {
            return cluster.select_unbounded(ctx.demand.hash, &ctx.failed);
        }
        self.shared
            .choose(|| cluster.select(&self.router.balance, *ctx.demand, &ctx.failed))
    }

    /// A retry after a failed connect when every other peer is at its bound: it waits in line
    /// like any request, skipping the peers that failed it, instead of losing the request to
    /// a 503 (the case of every request caught on an engine as it was killed).
    pub(crate) async fn wait_to_retry(&self, ctx: &mut RequestCtx) -> Result<(), Rejection> {
        let (routed, waited) = self.line_up(ctx, &ctx.failed).await?;
        took_turn(ctx, routed, waited);
        Ok(())
    }

    /// The waiting line's answer for this request: a slot on a peer not in `excluded`, and how
    /// long it waited, or the rejection that ended the wait.
    fn line_up<'a>(
        &'a self,
        ctx: &RequestCtx,
        excluded: &'a [Arc<Peer>],
    ) -> impl Future<Output = Result<(Routed, Duration), Rejection>> + 'a {
        let router = &self.router;
        let demand = *ctx.demand;
        // Each tenant waits in a lane of its own; without keys, everyone shares one.
        let lane = ctx.client.as_ref().map_or(0, |t| Arc::as_ptr(t) as u64);
        // A line per pool (models on the same peers share one): a request waits only behind
        // those that want the same slots.
        let key = router.cluster().pools().line_of(demand.model);
        let line = router.load().waiters().line(key);
        async move {
            line.admit(self.settings.queue, lane, move || {
                self.shared
                    .choose_in_turn(|| router.cluster().select(&router.balance, demand, excluded))
            })
            .await
        }
    }

    /// Waits in line for a slot, or for the rejection that ends the wait.
    async fn wait_in_line(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<(), Stop> {
        let admit = self.line_up(ctx, &[]);
        tokio::pin!(admit);
        // A client that leaves while it waits leaves the line at once, rather than being
        // admitted later and sent upstream. Only a request read to its end can be watched:
        // reading more of a body would take bytes that must go upstream.
        let admitted = if session.is_body_done() {
            tokio::select! {
                biased;
                admitted = &mut admit => admitted,
                gone = session.read_body_or_idle(true) => match gone {
                    Err(e) => {
                        metrics::REJECTIONS.with_label_values(&["client_gone"]).inc();
                        return Err(Stop::Failed(e.into_down()));
                    }
                    Ok(_) => admit.await,
                },
            }
        } else {
            admit.await
        };
        match admitted {
            Ok((routed, waited)) => {
                took_turn(ctx, routed, waited);
                Ok(())
            }
            Err(why) => {
                metrics::REJECTIONS.with_label_values(&[why.as_str()]).inc();
                // The body may still be on its way: closing on it would reset the connection
                // before the client reads the 503.
                Err(ApiError::rejected(why).into())
            }
        }
    }
}

/// Takes the slot a wait in line gave, and counts the wait.
fn took_turn(ctx: &mut RequestCtx, routed: Routed, waited: Duration) {
    if !waited.is_zero() {
        metrics::QUEUE_WAIT.observe(waited.as_secs_f64());
    }
    if let Some(trace) = ctx.trace.as_mut() {
        trace.waited(waited);
    }
    ctx.take_slot(routed);
}
