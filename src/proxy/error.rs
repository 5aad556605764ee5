//! Errors the way OpenAI-compatible clients read them: a status code and
//! `{"error": {"message", "type", "code"}}`.

use bytes::Bytes;
use http::HeaderName;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use pingora::{Error, ErrorSource, ErrorType};

use crate::routing::Rejection;
use crate::tenants::{AuthFailure, OverLimit};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's error `type`: `invalid_request_error`, `server_error`, or `requests` for a rate limit.
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub retry_after_secs: Option<u32>,
}

impl ApiError {
    pub fn body_too_large(limit: usize) -> Self {
        Self {
            status: 413,
            kind: "invalid_request_error",
            code: "request_too_large",
            message: format!("request body is larger than the limit of {limit} bytes"),
            retry_after_secs: None,
        }
    }

    /// 408 for a request whose `part` (its head, its body) did not arrive within `deadline`.
    pub fn request_timeout(part: &str, deadline: std::time::Duration) -> Self {
        Self {
            status: 408,
            kind: "invalid_request_error",
            code: "request_timeout",
            message: format!(
                "the request's {part} did not arrive within {} ms",
                deadline.as_millis()
            ),
            retry_after_secs: None,
        }
    }

    pub fn peek_memory_exhausted() -> Self {
        Self {
            status: 503,
            kind: "server_error",
            code: "peek_memory_exhausted",
            message: "too many request bodies are being read at once; try again".into(),
            retry_after_secs: Some(1),
        }
    }

    pub fn rejected(why: Rejection) -> Self {
        let (code, message) = match why {
            Rejection::NoPeer => ("no_healthy_upstream", "no inference server is available"),
            Rejection::QueueFull => (
                "cluster_saturated",
                "every inference server is at its in-flight limit and the wait queue is full",
            ),
            Rejection::Timeout => (
                "queue_timeout",
                "every inference server stayed at its in-flight limit for the whole queue timeout",
            ),
        };
        Self {
            status: 503,
            kind: "server_error",
            code,
            message: message.into(),
            retry_after_secs: Some(1),
        }
    }

    /// A path the balancer does not forward, told the way OpenAI tells an unknown URL.
    pub fn unknown_path(request: &pingora::http::RequestHeader) -> Self {
        Self {
            status: 404,
            kind: "invalid_request_error",
            code: "unknown_url",
            message: format!(
                "Invalid URL ({} {}): not an inference endpoint this load balancer forwards",
                request.method,
                request.uri.path()
            ),
            retry_after_secs: None,
        }
    }

    /// A request without a listed API key, told the way OpenAI tells it.
    pub fn unauthorized(why: AuthFailure) -> Self {
        let message = match why {
            AuthFailure::Missing => {
                "You didn't provide an API key. Send it in the Authorization header: Authorization: Bearer YOUR_KEY"
            }
            AuthFailure::Invalid => "Incorrect API key provided.",
        };
        Self {
            status: 401,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// A tenant over one of its limits.
    pub fn over_limit(over: OverLimit) -> Self {
        let message = match over {
            OverLimit::Concurrency => "too many concurrent requests for this API key",
            OverLimit::Requests(_) => "request rate limit reached for this API key",
            OverLimit::PromptBytes(_) => "prompt size rate limit reached for this API key",
        };
        Self {
            status: 429,
            kind: "requests",
            code: "rate_limit_exceeded",
            message: message.into(),
            retry_after_secs: Some(over.retry_after_secs()),
        }
    }

    /// A model no peer serves, told the way OpenAI tells it.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            kind: "invalid_request_error",
            code: "model_not_found",
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            retry_after_secs: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// An error that reached the client from the proxy phase, told by its status.
    pub fn from_status(status: u16) -> Self {
        let (kind, code, message) = match status {
            400..=499 => (
                "invalid_request_error",
                "bad_request",
                "the request could not be read",
            ),
            502 => (
                "server_error",
                "upstream_error",
                "the inference server failed or closed the connection",
            ),
            504 => (
                "server_error",
                "upstream_timeout",
                "the inference server did not answer in time",
            ),
            _ => (
                "server_error",
                "internal_error",
                "the load balancer failed to proxy the request",
            ),
        };
        Self {
            status,
            kind,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// A streamed answer whose engine sent nothing for `limit` once it had begun.
    pub fn stream_stalled(limit: std::time::Duration) -> Self {
        Self {
            status: 504,
            kind: "server_error",
            code: "upstream_stalled",
            message: format!(
                "the inference server sent nothing for {} s in the middle of the answer; it was ended here",
                limit.as_secs_f64()
            ),
            retry_after_secs: None,
        }
    }

    /// A streamed answer the engine broke off (closed, reset, or sent what is not HTTP).
    pub fn stream_broken(e: &Error) -> Self {
        Self {
            status: 502,
            kind: "server_error",
            code: "upstream_error",
            message: format!(
                "the inference server's answer broke off before its end ({})",
                e.etype().as_str()
            ),
            retry_after_secs: None,
        }
    }

    /// The error as the last event of a server-sent event stream.
    pub fn stream_event(&self) -> Bytes {
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(&self.body());
        event.extend_from_slice(b"\n\n");
        Bytes::from(event)
    }

    /// The error as the last event of a Messages API stream: a named `error` event in
    /// Anthropic's shape, as its SDKs read one (they pass over events without a name).
    pub fn messages_stream_event(&self) -> Bytes {
        let v = serde_json::json!({
            "type": "error",
            "error": { "type": "api_error", "message": self.message }
        });
        Bytes::from(format!("event: error\ndata: {v}\n\n"))
    }

    pub fn body(&self) -> Bytes {
        let v = serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "code": self.code }
        });
        Bytes::from(v.to_string())
    }

    /// The response header, with the request's id (header name and value) when it has one.
    pub fn header(
        &self,
        body_len: usize,
        request_id: Option<(&HeaderName, &str)>,
    ) -> pingora::Result<ResponseHeader> {
        let mut h = ResponseHeader::build(self.status, Some(5))?;
        h.insert_header("content-type", "application/json")?;
        h.insert_header("content-length", body_len.to_string())?;
        if let Some(secs) = self.retry_after_secs {
            h.insert_header("retry-after", secs.to_string())?;
        }
        if self.status == 401 {
            h.insert_header("www-authenticate", "Bearer")?;
        }
        if let Some((name, id)) = request_id {
            h.insert_header(name.clone(), id)?;
        }
        Ok(h)
    }

    /// Writes the error as the whole response.
    async fn send(
        &self,
        session: &mut Session,
        request_id: Option<(&HeaderName, &str)>,
    ) -> pingora::Result<()> {
        let body = self.body();
        let header = self.header(body.len(), request_id)?;
        session
            .write_response_header(Box::new(header), false)
            .await?;
        session.write_response_body(Some(body), true).await
    }

    /// Writes the error, then reads and drops what the client still sends of its body, for a
    /// while, before the connection closes: closing on unread bytes resets the connection, and
    /// a client still writing its body would see the reset instead of this answer. A client
    /// without a valid key gets nothing of its body read, not even to drop it.
    pub async fn send_and_close(
        &self,
        session: &mut Session,
        request_id: Option<(&HeaderName, &str)>,
    ) -> pingora::Result<()> {
        session.set_keepalive(None);
        self.send(session, request_id).await?;
        if self.status != 401 && !session.is_body_done() {
            let _ = tokio::time::timeout(LINGER, session.drain_request_body()).await;
        }
        Ok(())
    }
}

/// How long an answered connection keeps reading the client's unwanted body.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// The status a proxy error is answered with; 0 when the client is gone.
pub fn status_for(e: &Error) -> u16 {
    match e.etype() {
        ErrorType::HTTPStatus(code) => *code,
        ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout
            if e.esource() == &ErrorSource::Upstream =>
        {
            504
        }
        _ => match e.esource() {
            ErrorSource::Upstream => 502,
            ErrorSource::Downstream => match e.etype() {
                // Gone, or not reading: nothing more can be told to it. On HTTP/2 a client
                // that leaves resets its stream, which Pingora reports as an H2 error.
                ErrorType::WriteError
                | ErrorType::WriteTimedout
                | ErrorType::ReadError
                | ErrorType::ConnectionClosed
                | ErrorType::H2Error => 0,
                ErrorType::ReadTimedout => 408,
                _ => 400,
            },
            ErrorSource::Internal | ErrorSource::Unset => 500,
        },
    }
}
