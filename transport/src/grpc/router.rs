//! Picks the service for a call on the task that decoded it: one hash lookup on the service
//! name in the method path, then the service is called in place.
//!
//! tonic's `Routes` is an axum router: per call it clones the router, matches the path in a
//! radix tree, stores the matched parameters in the request's extensions, clones the boxed
//! service and drives it through a `Oneshot`, and re-boxes the request body twice on the
//! way (about 5 k instructions and 8 allocations of a 64 B Echo's 39 k and 46 on the
//! server, counted with callgrind). The parameters it stores are private to axum, so
//! skipping it changes nothing a service can see. Services added as whole `Routes` (and
//! paths no service added here serves) still go through tonic's router, whose fallback
//! answers `Unimplemented` exactly as over HTTP/2.

use crate::map::Map;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tonic::server::NamedService;
use tonic::service::Routes;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

/// What every service answers: tonic's body, which generated services answer with already
/// (anything else a tower layer makes is boxed into one).
pub(crate) type Response = http::Response<tonic::body::Body>;
type Request = http::Request<tonic::body::Body>;
type Svc = BoxCloneSyncService<Request, Response, Infallible>;

/// A handler's answer, boxed once (by the boxed service itself).
pub(crate) type Handler = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// The services of a server. Each connection holds its own clone, so a service is called
/// through `&mut` with no clone per call while it is ready.
#[derive(Clone, Default)]
pub(crate) struct Router {
    services: Map<&'static str, Svc>,
    /// tonic's router: services added as `Routes`, and the `Unimplemented` fallback.
    fallback: Routes,
}

impl Router {
    pub(crate) fn add_service<S>(&mut self, svc: S)
    where
        S: Service<Request, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
        S::Response: axum::response::IntoResponse + 'static,
        S::Future: Send + 'static,
    {
        let svc = svc.map_response(into_response);
        self.services.insert(S::NAME, BoxCloneSyncService::new(svc));
    }

    /// Sets the router that serves what no service added here does.
    pub(crate) fn set_fallback(&mut self, routes: Routes) {
        self.fallback = routes.prepare();
    }

    /// Starts the call: the handler's future, which runs wherever it is polled.
    pub(crate) fn call(&mut self, req: Request) -> Handler {
        let svc = service_name(req.uri().path()).and_then(|name| self.services.get_mut(name));
        let Some(svc) = svc else {
            let mut routes = self.fallback.clone();
            return Box::pin(async move {
                let resp = ServiceExt::<Request>::ready(&mut routes)
                    .await?
                    .call(req)
                    .await?;
                Ok(resp.map(tonic::body::Body::new))
            });
        };
        // Generated services are always ready; one that is not (a concurrency limit in a
        // tower layer) is waited for on a clone, as tonic's router waits for every call.
        let mut cx = Context::from_waker(Waker::noop());
        match svc.poll_ready(&mut cx) {
            Poll::Ready(Ok(())) => svc.call(req),
            Poll::Pending => Box::pin(svc.clone().oneshot(req)),
            Poll::Ready(Err(never)) => match never {},
        }
    }
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("services", &self.services.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A service's answer as tonic's body. A generated service's answer is one already and is
/// passed through: axum's `into_response`, which tonic's router applies, boxes it into
/// axum's body, which costs an allocation and two more dynamic calls for each of the body's
/// frames (about 900 instructions of a 64 B Echo, callgrind).
fn into_response<R: axum::response::IntoResponse + 'static>(r: R) -> Response {
    let mut slot = Some(r);
    if let Some(resp) = (&mut slot as &mut dyn std::any::Any)
        .downcast_mut::<Option<Response>>()
        .and_then(Option::take)
    {
        return resp;
    }
    match slot {
        Some(r) => r.into_response().map(tonic::body::Body::new),
        // Taken only when it was already a `Response`, which returned above.
        None => tonic::Status::internal("the service's response was lost").into_http(),
    }
}

/// `pkg.Service` of `/pkg.Service/Method`; `None` unless both parts are there (tonic's
/// router matches `/{name}/{*rest}`, which needs a method).
fn service_name(path: &str) -> Option<&str> {
    let (name, method) = path.strip_prefix('/')?.split_once('/')?;
    (!name.is_empty() && !method.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_tonic_response_passes_through_and_others_are_converted() {
        let mut resp = http::Response::new(tonic::body::Body::new(http_body_util::Full::new(
            bytes::Bytes::from_static(b"tonic"),
        )));
        resp.headers_mut()
            .insert("x-kept", http::HeaderValue::from_static("1"));
        let out = into_response(resp);
        assert_eq!(out.headers()["x-kept"], "1");
        let body = out.into_body().collect().await.map(|c| c.to_bytes());
        assert_eq!(body.ok().as_deref(), Some(&b"tonic"[..]));

        // What a tower layer might answer with: any `IntoResponse`.
        let mut other = http::Response::new(String::from("plain"));
        *other.status_mut() = http::StatusCode::ACCEPTED;
        let out = into_response(other);
        assert_eq!(out.status(), http::StatusCode::ACCEPTED);
        let body = out.into_body().collect().await.map(|c| c.to_bytes());
        assert_eq!(body.ok().as_deref(), Some(&b"plain"[..]));
    }

    #[test]
    fn the_service_name_is_the_first_path_segment() {
        assert_eq!(service_name("/pkg.Svc/Method"), Some("pkg.Svc"));
        assert_eq!(service_name("/pkg.Svc/a/b"), Some("pkg.Svc"));
        assert_eq!(service_name("/pkg.Svc/"), None);
        assert_eq!(service_name("/pkg.Svc"), None);
        assert_eq!(service_name("//Method"), None);
        assert_eq!(service_name("pkg.Svc/Method"), None);
    }
}
