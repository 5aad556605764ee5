//! What the proxy reads of the client's side of the exchange.

use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::forwarding::Forwarding;

/// Whether a request takes a bounded slot and may wait for one (see [`Forwarding::is_light`]).
pub fn bounded(session: &Session) -> bool {
    let header = session.req_header();
    !Forwarding::is_light(&header.method, header.uri.path())
}

pub fn client_ip(session: &Session) -> Option<std::net::IpAddr> {
    session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip())
}

/// The final response header sent to the client, if one was. A `100 Continue` sent during the
/// peek is not one: an error after it must still be answered, and logged, as itself.
pub fn final_response(session: &Session) -> Option<&ResponseHeader> {
    session
        .response_written()
        .filter(|r| !r.status.is_informational())
}
