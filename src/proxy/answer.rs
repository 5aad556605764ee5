//! How the proxy answers the client itself: at once, when a step of the request filter stops
//! the request, or through `fail_to_proxy`, when a later hook fails on purpose.

use pingora::proxy::Session;
use pingora::{Error, ErrorType, Result};

use super::ctx::RequestCtx;
use super::error::ApiError;
use super::lb::PrefixLb;
use crate::metrics;
use crate::routing::Rejection;

/// Why a step of the request filter ends the request before it goes upstream.
pub enum Stop {
    /// Answer the client with this error.
    Error(ApiError),
    /// Answer the model list, which prefixlb serves itself when it routes by model.
    Models(Vec<String>),
    /// Pingora's own error (the client went away, or could not be read): Pingora ends the
    /// request.
    Failed(Box<Error>),
}

impl From<ApiError> for Stop {
    fn from(api: ApiError) -> Self {
        Self::Error(api)
    }
}

impl From<Box<Error>> for Stop {
    fn from(e: Box<Error>) -> Self {
        Self::Failed(e)
    }
}

impl PrefixLb {
    /// Answers the client with `api`, with this request's id, and ends the exchange.
    pub(crate) async fn answer(
        &self,
        session: &mut Session,
        ctx: &RequestCtx,
        api: &ApiError,
    ) -> Result<()> {
        let id = self
            .forwarding
            .request_id_header()
            .zip(ctx.request_id.as_deref());
        api.send_and_close(session, id).await
    }
}

/// Counts the rejection and fails the hook with it, for `fail_to_proxy` to answer.
pub fn reject(ctx: &mut RequestCtx, why: Rejection) -> Box<Error> {
    metrics::REJECTIONS.with_label_values(&[why.as_str()]).inc();
    fail(ctx, ApiError::rejected(why))
}

/// Fails the hook with `api`, for `fail_to_proxy` to answer.
pub fn fail(ctx: &mut RequestCtx, api: ApiError) -> Box<Error> {
    let status = api.status;
    let why = api.message.clone();
    ctx.error = Some(Box::new(api));
    Error::explain(ErrorType::HTTPStatus(status), why)
}
