//! The first step of the request filter, on the headers alone: who may come in, and where to.

use pingora::proxy::Session;

use super::answer::Stop;
use super::ctx::RequestCtx;
use super::error::ApiError;
use super::lb::PrefixLb;
use crate::metrics;

impl PrefixLb {
    /// Admits the request: its tenant within its limits, its path on the allowlist.
    pub(crate) fn admit(&self, session: &Session, ctx: &mut RequestCtx) -> Result<(), Stop> {
        self.admit_tenant(session, ctx)?;
        if !self.forwarding.allows(session.req_header().uri.path()) {
            metrics::REJECTIONS
                .with_label_values(&["path_not_allowed"])
                .inc();
            return Err(ApiError::unknown_path(session.req_header()).into());
        }
        Ok(())
    }

    /// Takes the tenant's hold on the request, or says the answer that ends it: 401 without a
    /// listed key, 429 over the tenant's limits.
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
}
