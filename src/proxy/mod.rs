//! The Pingora side: a `ProxyHttp` whose hooks only hand the request to the routing core and
//! keep the slot it returns for as long as the response runs.
//!
//! `request_filter` peeks at the body for the key and waits in line for a slot;
//! `upstream_peer` turns the slot into an `HttpPeer`; `fail_to_connect` gives the slot back and
//! marks the peer failed for this request, so the next call picks another; `logging` (and, as a
//! backstop, dropping the context) releases the slot when the response has ended or the client
//! has gone.

mod ctx;
pub mod error;
mod forwarding;
pub mod peek;
pub mod service;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use pingora::prelude::*;
use pingora::proxy::FailToProxy;
use pingora::{Error, ErrorType};

use crate::access_log::{AccessLog, Entry};
use crate::control::shared_load::SharedLoad;
use crate::lifecycle::Activity;
use crate::metrics;
use crate::router::Router;
use crate::routing::{is_peer_fault, Decision, KeySource, Peer, PoolChoice, Rejection};

/// The model list's path, which prefixlb answers itself when it routes by model.
const MODELS_PATH: &str = "/v1/models";
use crate::settings::ProxySettings;
use crate::tenants::ClientAuth;
use ctx::RequestCtx;
use error::{status_for, ApiError};
use forwarding::Forwarding;
use peek::{declared_length, expects_continue, peek_key, PeekMemory};

pub struct PrefixLb {
    router: Arc<Router>,
    settings: ProxySettings,
    access_log: AccessLog,
    forwarding: Forwarding,
    peek_memory: Arc<PeekMemory>,
    activity: Arc<Activity>,
    shared: Arc<SharedLoad>,
    auth: Option<ClientAuth>,
}

impl PrefixLb {
    pub fn new(
        router: Arc<Router>,
        settings: ProxySettings,
        activity: Arc<Activity>,
        shared: Arc<SharedLoad>,
    ) -> Self {
        Self {
            router,
            access_log: AccessLog::new(settings.access_log, settings.access_log_key.as_deref()),
            forwarding: Forwarding::new(settings.forwarding.clone()),
            peek_memory: PeekMemory::new(settings.peek.memory),
            settings,
            activity,
            shared,
            auth: None,
        }
    }

    /// Serves only clients with a listed API key, each within its tenant's limits.
    pub fn with_auth(self, auth: ClientAuth) -> Self {
        Self {
            auth: Some(auth),
            ..self
        }
    }

    /// Takes the tenant's hold on the request, or says the answer that ends it: 401 without a
    /// listed key, 429 over the tenant's limits. Runs on the headers alone.
    fn admit_tenant(&self, session: &Session, ctx: &mut RequestCtx) -> Result<(), ApiError> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        let header = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        let tenant = auth.tenants.authenticate(header).map_err(|why| {
            metrics::AUTH_FAILURES
                .with_label_values(&[why.as_str()])
                .inc();
            ApiError::unauthorized(why)
        })?;
        let outcome = tenant.admit();
        if let Err(over) = &outcome {
            metrics::TENANT_REQUESTS
                .with_label_values(&[tenant.name(), over.as_str()])
                .inc();
        }
        ctx.client = Some(tenant);
        ctx.tenant = Some(outcome.map_err(ApiError::over_limit)?);
        Ok(())
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

    /// Counts a failed request against `peer`, and says so when that ejected it.
    fn peer_failed(&self, peer: &Peer) {
        if let Some(backoff) = self.router.peer_failed(peer) {
            metrics::PEER_EJECTIONS
                .with_label_values(&[peer.id()])
                .inc();
            log::warn!(
                "ejecting peer {} for {backoff:?}: repeated failures",
                peer.id()
            );
        }
    }

    /// Answers the client with `api`, with this request's id, and ends the exchange.
    async fn answer(&self, session: &mut Session, ctx: &RequestCtx, api: &ApiError) -> Result<()> {
        let id = self
            .forwarding
            .request_id_header()
            .zip(ctx.request_id.as_deref());
        api.send_and_close(session, id).await
    }

    /// The model list, as OpenAI's `GET /v1/models` gives it.
    async fn answer_models(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        names: &[String],
    ) -> Result<()> {
        let data: Vec<_> = names
            .iter()
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "prefixlb"}))
            .collect();
        let body = Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string());
        let mut header = ResponseHeader::build(200, Some(4))?;
        header.insert_header("content-type", "application/json")?;
        header.insert_header("content-length", body.len().to_string())?;
        if let (Some(name), Some(id)) = (self.forwarding.request_id_header(), &ctx.request_id) {
            header.insert_header(name.clone(), id.as_str())?;
        }
        session
            .write_response_header(Box::new(header), false)
            .await?;
        session.write_response_body(Some(body), true).await
    }

    /// Chooses the peer for a request that skips the waiting line: a retry after a failed
    /// connect, or a request too light to be bounded.
    fn choose_now(&self, session: &Session, ctx: &RequestCtx) -> Decision {
        let cluster = self.router.cluster();
        if !bounded(session) {
            return cluster.select_unbounded(ctx.demand.hash, &ctx.failed);
        }
        self.shared
            .choose(|| cluster.select(&self.router.balance, *ctx.demand, &ctx.failed))
    }
}

/// Whether a request takes a bounded slot and may wait for one (see [`Forwarding::is_light`]).
fn bounded(session: &Session) -> bool {
    let header = session.req_header();
    !Forwarding::is_light(&header.method, header.uri.path())
}

fn client_ip(session: &Session) -> Option<std::net::IpAddr> {
    session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip())
}

/// The final response header sent to the client, if one was. A `100 Continue` sent during the
/// peek is not one: an error after it must still be answered, and logged, as itself.
fn final_response(session: &Session) -> Option<&ResponseHeader> {
    session
        .response_written()
        .filter(|r| !r.status.is_informational())
}

fn reject(ctx: &mut RequestCtx, why: Rejection) -> Box<Error> {
    metrics::REJECTIONS.with_label_values(&[why.as_str()]).inc();
    fail(ctx, ApiError::rejected(why))
}

fn fail(ctx: &mut RequestCtx, api: ApiError) -> Box<Error> {
    let status = api.status;
    let why = api.message.clone();
    ctx.error = Some(api);
    Error::explain(ErrorType::HTTPStatus(status), why)
}

#[async_trait]
impl ProxyHttp for PrefixLb {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::new(self.activity.request())
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        session.set_write_timeout(Some(self.settings.client_write_timeout));
        // Requests a client sends before reading the answer to the one before are answered in
        // turn, instead of being dropped with the connection.
        session.set_pipelining_enabled(true);
        ctx.request_id = self.forwarding.request_id(&session.req_header().headers);
        if let Err(api) = self.admit_tenant(session, ctx) {
            self.answer(session, ctx, &api).await?;
            return Ok(true);
        }
        if !self.forwarding.allows(session.req_header().uri.path()) {
            metrics::REJECTIONS
                .with_label_values(&["path_not_allowed"])
                .inc();
            let api = ApiError::unknown_path(session.req_header());
            self.answer(session, ctx, &api).await?;
            return Ok(true);
        }
        let router = &self.router;
        // With pools, prefixlb answers the model list itself: the union of what they serve.
        let pooled = router.cluster().pools().active();
        let header = session.req_header();
        if pooled && header.method == http::Method::GET && header.uri.path() == MODELS_PATH {
            let names: Vec<String> = router
                .cluster()
                .pools()
                .models()
                .map(str::to_owned)
                .collect();
            self.answer_models(session, ctx, &names).await?;
            return Ok(true);
        }
        let limits = self.settings.peek;
        if declared_length(&session.req_header().headers).is_some_and(|len| len > limits.max_body) {
            self.answer(session, ctx, &ApiError::body_too_large(limits.max_body))
                .await?;
            return Ok(true);
        }
        let header = session.req_header();
        let mut model = None;
        // The prompt's size prices it: declared, or as far as the peek read it.
        let mut body_bytes = declared_length(&header.headers).unwrap_or(0);
        let key = if router
            .keys
            .body_kind(&header.method, header.uri.path(), &header.headers)
            .is_some()
        {
            // The deadline covers the whole read: a client trickling a byte now and then is
            // cut off however short each pause.
            let peek = peek_key(session, &router.keys, limits, &self.peek_memory, pooled);
            let peeked = tokio::time::timeout(limits.deadline, peek)
                .await
                .unwrap_or_else(|_| Ok(Err(ApiError::peek_timeout(limits.deadline))));
            match peeked? {
                Ok(peeked) => {
                    metrics::PEEKED_BYTES.inc_by(peeked.bytes as u64);
                    ctx.unreplayed = peeked.unreplayed;
                    ctx.peek_held = Some(peeked.held);
                    ctx.continued = expects_continue(session);
                    body_bytes = body_bytes.max(peeked.bytes);
                    model = peeked.model;
                    peeked.key
                }
                Err(api) => {
                    self.answer(session, ctx, &api).await?;
                    return Ok(true);
                }
            }
        } else {
            router
                .keys
                .key_without_body(&session.req_header().headers, client_ip(session))
        };
        if let Err(api) = self.charge_prompt(ctx, body_bytes) {
            self.answer(session, ctx, &api).await?;
            return Ok(true);
        }
        ctx.key_source = Some(key.source);
        *ctx.demand = router.keys.demand(&key, body_bytes);
        let default = self.settings.default_model.as_deref();
        let pool = match pooled {
            true => router.cluster().pools().choose(model.as_deref(), default),
            false => PoolChoice::Any,
        };
        match pool {
            PoolChoice::Any => {}
            PoolChoice::Model(id) => ctx.demand.model = Some(id),
            PoolChoice::Unknown => {
                metrics::REJECTIONS
                    .with_label_values(&["model_not_found"])
                    .inc();
                let name = model.as_deref().or(default).unwrap_or_default();
                self.answer(session, ctx, &ApiError::model_not_found(name))
                    .await?;
                return Ok(true);
            }
        }
        metrics::KEY_SOURCES
            .with_label_values(&[key.source.as_str()])
            .inc();
        if !bounded(session) {
            return match self.choose_now(session, ctx) {
                Decision::Routed(routed) => {
                    ctx.take_slot(routed);
                    Ok(false)
                }
                _ => {
                    metrics::REJECTIONS.with_label_values(&["no_peer"]).inc();
                    self.answer(session, ctx, &ApiError::rejected(Rejection::NoPeer))
                        .await?;
                    Ok(true)
                }
            };
        }
        let demand = *ctx.demand;
        // Each tenant waits in a lane of its own; without keys, everyone shares one.
        let lane = ctx.client.as_ref().map_or(0, |t| Arc::as_ptr(t) as u64);
        let admit = router
            .load()
            .waiters()
            .admit(self.settings.queue, lane, || {
                self.shared
                    .choose_in_turn(|| router.cluster().select(&router.balance, demand, &[]))
            });
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
                        return Err(e.into_down());
                    }
                    Ok(_) => admit.await,
                },
            }
        } else {
            admit.await
        };
        match admitted {
            Ok((routed, waited)) => {
                if !waited.is_zero() {
                    metrics::QUEUE_WAIT.observe(waited.as_secs_f64());
                }
                ctx.take_slot(routed);
                Ok(false)
            }
            Err(why) => {
                metrics::REJECTIONS.with_label_values(&[why.as_str()]).inc();
                // The body may still be on its way: closing on it would reset the connection
                // before the client reads the 503.
                self.answer(session, ctx, &ApiError::rejected(why)).await?;
                Ok(true)
            }
        }
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        if ctx.slot.is_none() {
            // A retry after a failed connect: the next peer on the walk, no waiting in line.
            match self.choose_now(session, ctx) {
                Decision::Routed(routed) => ctx.take_slot(routed),
                Decision::Saturated => return Err(reject(ctx, Rejection::RetrySaturated)),
                Decision::NoPeer => return Err(reject(ctx, Rejection::NoPeer)),
            }
        }
        let Some(slot) = ctx.slot.as_ref() else {
            return Err(fail(ctx, ApiError::from_status(500)));
        };
        // Each attempt's body starts again from the replayed bytes: put ours in front of them.
        ctx.unreplayed_due = ctx.unreplayed.is_some();
        let up = &self.settings.upstream;
        let mut peer = crate::tls::http_peer(slot.peer(), &up.tls);
        peer.options.connection_timeout = Some(up.connect_timeout);
        peer.options.total_connection_timeout = Some(up.connect_timeout);
        peer.options.read_timeout = Some(up.read_timeout);
        peer.options.write_timeout = Some(up.write_timeout);
        peer.options.idle_timeout = Some(up.idle_timeout);
        Ok(Box::new(peer))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(slot) = ctx.slot.take() {
            metrics::PEER_CONNECT_FAILURES
                .with_label_values(&[slot.peer().id()])
                .inc();
            self.peer_failed(slot.peer());
            ctx.failed.push(Arc::clone(slot.peer()));
        }
        // Nothing has reached the client yet, so another peer is safe to try.
        e.set_retry(ctx.failed.len() <= self.settings.upstream.connect_retries);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        _ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        // Once response bytes reached the client, or the body cannot be replayed, a retry
        // would corrupt the response or the request.
        if final_response(session).is_some()
            || !session.req_header().method.is_idempotent()
            || session.retry_buffer_truncated()
        {
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if ctx.continued {
            upstream_request.remove_header(&http::header::EXPECT);
        }
        if self.auth.as_ref().is_some_and(|a| !a.forward_key) {
            upstream_request.remove_header(&http::header::AUTHORIZATION);
        }
        self.forwarding.apply(
            upstream_request,
            client_ip(session),
            ctx.request_id.as_deref(),
        )?;
        // A length sent as `42, 42` (or twice) goes upstream once: servers may refuse the list.
        let lengths = upstream_request
            .headers
            .get_all(http::header::CONTENT_LENGTH);
        let listed =
            lengths.iter().count() > 1 || lengths.iter().any(|v| v.as_bytes().contains(&b','));
        if listed {
            if let Some(n) = declared_length(&session.req_header().headers) {
                upstream_request.insert_header(http::header::CONTENT_LENGTH, n.to_string())?;
            }
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.upstream_status = Some(upstream_response.status.as_u16());
        // Once the engine answers, no other attempt follows: the bytes kept for one, and their
        // share of the peek memory, can go (once the first body chunk has carried them).
        if !ctx.unreplayed_due {
            ctx.unreplayed = None;
            ctx.peek_held = None;
        }
        if let Some(slot) = &ctx.slot {
            if is_peer_fault(upstream_response.status.as_u16()) {
                self.peer_failed(slot.peer());
            } else {
                slot.peer().record_success();
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        // A 1.0 client cannot read chunked framing: a body of unknown length (an SSE stream)
        // reaches it delimited by the close instead.
        if session.req_header().version == http::Version::HTTP_10
            && !upstream_response
                .headers
                .contains_key(http::header::CONTENT_LENGTH)
        {
            upstream_response.remove_header(&http::header::TRANSFER_ENCODING);
            session.set_keepalive(None);
        }
        if let (Some(name), Some(id)) = (self.forwarding.request_id_header(), &ctx.request_id) {
            upstream_response.insert_header(name.clone(), id.as_str())?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if let Some(front) = ctx.unreplayed_due.then(|| ctx.unreplayed.clone()).flatten() {
            ctx.unreplayed_due = false;
            *body = Some(match body.take() {
                Some(rest) if !rest.is_empty() => {
                    let mut joined = BytesMut::with_capacity(front.len() + rest.len());
                    joined.extend_from_slice(&front);
                    joined.extend_from_slice(&rest);
                    joined.freeze()
                }
                _ => front,
            });
        }
        let limit = self.settings.peek.max_body;
        if session.body_bytes_read() > limit {
            return Err(fail(ctx, ApiError::body_too_large(limit)));
        }
        Ok(())
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        if ctx.first_byte.is_none() && body.as_ref().is_some_and(|b| !b.is_empty()) {
            if let Some(chosen) = ctx.chosen {
                let ttfb = chosen.elapsed();
                metrics::FIRST_BYTE.observe(ttfb.as_secs_f64());
                ctx.first_byte = Some(ttfb);
                if let Some(slot) = ctx.slot.as_mut() {
                    slot.prefilled();
                }
            }
        }
        Ok(None)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        // The response has ended or the client has gone: either way the slot is free now.
        let slot = ctx.slot.take();
        let served_by = slot
            .as_ref()
            .map(|s| Arc::clone(s.peer()))
            .or(ctx.released.take());
        drop(slot);
        let duration = ctx.arrived.elapsed();
        metrics::DURATION.observe(duration.as_secs_f64());
        let route = ctx.route_label();
        // A peer removed while this ran has had its series dropped; counting it now would bring
        // them back, for good.
        if let (Some(p), Some(route)) = (served_by.as_ref().filter(|p| !p.removed()), route) {
            metrics::PEER_REQUESTS
                .with_label_values(&[p.id(), route, metrics::status_class(ctx.upstream_status)])
                .inc();
        }
        let peer = served_by.map(|p| p.id().to_owned());
        if !self.access_log.enabled() {
            return;
        }
        let header = session.req_header();
        self.access_log.write(&Entry {
            time: jiff::Timestamp::now().to_string(),
            method: header.method.as_str(),
            path: header.uri.path(),
            status: final_response(session).map_or(0, |r| r.status.as_u16()),
            peer: peer.as_deref(),
            route,
            request_id: ctx.request_id.as_deref(),
            tenant: ctx.client.as_ref().map(|t| t.name()),
            key_source: ctx.key_source.map(KeySource::as_str),
            key_hash: ctx
                .key_source
                .and(ctx.demand.hash)
                .map(|h| self.access_log.key_label(h)),
            ttft_ms: ctx.first_byte.map(|d| d.as_millis() as u64),
            duration_ms: duration.as_millis() as u64,
            bytes_in: session.body_bytes_read(),
            bytes_out: session.body_bytes_sent(),
            error: e.map(|e| e.to_string()),
        });
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let api = match ctx.error.take() {
            Some(api) => api,
            None => match status_for(e) {
                0 => {
                    return FailToProxy {
                        error_code: 0,
                        can_reuse_downstream: false,
                    }
                }
                status => ApiError::from_status(status),
            },
        };
        // The request is over for the peer: free its slot before lingering on the client.
        if let Some(slot) = ctx.slot.take() {
            ctx.released = Some(Arc::clone(slot.peer()));
        }
        if final_response(session).is_none() {
            if let Err(write) = self.answer(session, ctx, &api).await {
                log::debug!("could not send the error response: {write}");
            }
        }
        FailToProxy {
            error_code: api.status,
            can_reuse_downstream: false,
        }
    }
}
