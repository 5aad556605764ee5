//! The request filter's gate: the body within its size, the routing key read from it (or from
//! the headers), and the prompt charged to its tenant.

use pingora::proxy::Session;

use super::answer::Stop;
use super::client::client_ip;
use super::ctx::RequestCtx;
use super::error::ApiError;
use super::lb::PrefixLb;
use super::peek::{declared_length, expects_continue, peek_key};
use crate::metrics;
use crate::routing::RoutingKey;

/// What the gate read of a request, for the route to go on from.
pub struct Prompt {
    pub key: RoutingKey,
    /// The model the body asks for, when it was looked for and found.
    pub model: Option<String>,
    /// The stored response a Responses request continues, when it names one.
    pub previous: Option<String>,
    /// The prompt's size, which prices it: declared, or as far as the peek read it.
    pub bytes: usize,
}

impl PrefixLb {
    /// Passes a request whose body is within the limit, and whose prompt its tenant can pay
    /// for; leaves its key and demand in `ctx`. `pooled` asks the peek for the model too.
    pub(crate) async fn gate(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        pooled: bool,
    ) -> Result<Prompt, Stop> {
        let max_body = self.settings.peek.max_body;
        let declared = declared_length(&session.req_header().headers);
        if declared.is_some_and(|len| len > max_body) {
            return Err(ApiError::body_too_large(max_body).into());
        }
        let prompt = self.read_key(session, ctx, pooled, declared).await?;
        self.charge_prompt(ctx, prompt.bytes)?;
        ctx.key_source = Some(prompt.key.source);
        *ctx.demand = self.router.keys.demand(&prompt.key, prompt.bytes);
        Ok(prompt)
    }

    /// The request's key: peeked at in a prompt-carrying body, else read from the headers.
    async fn read_key(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        pooled: bool,
        declared: Option<usize>,
    ) -> Result<Prompt, Stop> {
        let keys = &self.router.keys;
        let header = session.req_header();
        let bytes = declared.unwrap_or(0);
        // A client waiting for `100 Continue` before it uploads, with its session in a
        // header, is admitted on the header alone (a full cluster refuses it before the
        // upload); unless the body must say which pool serves its model.
        let by_header = !pooled && expects_continue(session) && keys.has_session(&header.headers);
        if by_header || keys.body_kind(&header.method, header.uri.path()).is_none() {
            let key = keys.key_without_body(&header.headers, client_ip(session));
            return Ok(Prompt {
                key,
                model: None,
                previous: None,
                bytes,
            });
        }
        let limits = self.settings.peek;
        // The deadline covers the whole read: a client trickling a byte now and then is cut off
        // however short each pause.
        let peek = peek_key(session, keys, limits, &self.peek_memory, pooled);
        let peeked = tokio::time::timeout(limits.deadline, peek)
            .await
            .unwrap_or_else(|_| Ok(Err(ApiError::request_timeout("body", limits.deadline))))??;
        metrics::PEEKED_BYTES.inc_by(peeked.bytes as u64);
        ctx.unreplayed = peeked.unreplayed;
        ctx.peek_held = Some(peeked.held);
        ctx.continued = expects_continue(session);
        Ok(Prompt {
            key: peeked.key,
            model: peeked.model,
            previous: peeked.previous,
            bytes: bytes.max(peeked.bytes),
        })
    }

    /// Charges the prompt to its tenant's byte rate.
    fn charge_prompt(&self, ctx: &RequestCtx, bytes: usize) -> Result<(), ApiError> {
        let Some(tenant) = &ctx.client else {
            return Ok(());
        };
        let charged = tenant.charge_prompt(bytes);
        let outcome = charged
            .as_ref()
            .map_or_else(|o| o.as_str(), |()| "admitted");
        metrics::TENANT_REQUESTS
            .with_label_values(&[tenant.name(), outcome])
            .inc();
        charged.map_err(ApiError::over_limit)
    }
}
