//! The model list, which prefixlb answers itself when it routes by model: the union of what its
//! pools serve, as OpenAI's `GET /v1/models` gives it.

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use pingora::Result;

use super::answer::Stop;
use super::ctx::RequestCtx;
use super::lb::PrefixLb;

/// The model list's path.
const MODELS_PATH: &str = "/v1/models";

impl PrefixLb {
    /// Stops a request for the model list, to answer it here, when the cluster has pools.
    pub(crate) fn list_models(&self, session: &Session, pooled: bool) -> Result<(), Stop> {
        let header = session.req_header();
        if pooled && header.method == http::Method::GET && header.uri.path() == MODELS_PATH {
            let cluster = self.router.cluster();
            let names = cluster.pools().models().map(str::to_owned).collect();
            return Err(Stop::Models(names));
        }
        Ok(())
    }

    /// Answers the model list of `names`.
    pub(crate) async fn answer_models(
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
}
