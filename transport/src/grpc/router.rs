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
use std::any::TypeId;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use http::uri::PathAndQuery;
use tonic::server::NamedService;
use tonic::service::Routes;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use super::direct::{DirectProbe, DirectRoute};

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
    /// The type each service was added as, which a generated route checks before it offers
    /// itself as a direct route (see [`DirectProbe`]).
    types: Map<&'static str, TypeId>,
    /// tonic's router: services added as `Routes`, and the `Unimplemented` fallback.
    fallback: Routes,
    /// The direct routes this connection has learned, by method path; `None`: the path has
    /// none (not a generated unary route, or one behind a wrapper). At most
    /// [`Router::DIRECT_MAX`] paths, so a peer that calls many paths costs no memory.
    direct: Vec<(PathAndQuery, Option<DirectRoute>)>,
}

/// What [`Router::direct`] knows of a method path.
pub(crate) enum Direct<'a> {
    /// The path's direct route.
    Route(&'a DirectRoute),
    /// Not known yet: the call goes the usual way carrying this probe, and
    /// [`Router::learn`] records what it found.
    Probe(DirectProbe),
    /// No direct route, or no room to learn one.
    None,
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
        self.types.insert(S::NAME, TypeId::of::<S>());
    }

    const DIRECT_MAX: usize = 16;

    /// The direct route of `path`, if this connection knows it has one.
    pub(crate) fn direct(&self, path: &PathAndQuery) -> Direct<'_> {
        if let Some((_, route)) = self.direct.iter().find(|(p, _)| p == path) {
            return route.as_ref().map_or(Direct::None, Direct::Route);
        }
        if self.direct.len() >= Self::DIRECT_MAX {
            return Direct::None;
        }
        match service_name(path.path()).and_then(|name| self.types.get(name)) {
            Some(&outer) => Direct::Probe(DirectProbe {
                outer,
                slot: Default::default(),
            }),
            None => Direct::None,
        }
    }

    /// Records what a call that carried `probe` found: the route its service offered, or
    /// none (a route that did not take the probe in its first poll is taken to have none).
    /// True when a route was learned.
    pub(crate) fn learn(&mut self, path: PathAndQuery, probe: DirectProbe) -> bool {
        if self.direct.len() >= Self::DIRECT_MAX || self.direct.iter().any(|(p, _)| *p == path) {
            return false;
        }
        let route = probe.slot.get().cloned();
        let learned = route.is_some();
        self.direct.push((path, route));
        learned
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
