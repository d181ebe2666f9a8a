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

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tonic::server::NamedService;
use tonic::service::Routes;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

/// What every service answers, whatever its own response body: axum's body, as through
/// tonic's router.
pub(crate) type Response = http::Response<axum::body::Body>;
type Request = http::Request<tonic::body::Body>;
type Svc = BoxCloneSyncService<Request, Response, Infallible>;

/// A handler's answer, boxed once (by the boxed service itself).
pub(crate) type Handler = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// The services of a server. Each connection holds its own clone, so a service is called
/// through `&mut` with no clone per call while it is ready.
#[derive(Clone, Default)]
pub(crate) struct Router {
    services: HashMap<&'static str, Svc>,
    /// tonic's router: services added as `Routes`, and the `Unimplemented` fallback.
    fallback: Routes,
}

impl Router {
    pub(crate) fn add_service<S>(&mut self, svc: S)
    where
        S: Service<Request, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        let svc = svc.map_response(axum::response::IntoResponse::into_response);
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
                Ok(resp.map(axum::body::Body::new))
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

/// `pkg.Service` of `/pkg.Service/Method`; `None` unless both parts are there (tonic's
/// router matches `/{name}/{*rest}`, which needs a method).
fn service_name(path: &str) -> Option<&str> {
    let (name, method) = path.strip_prefix('/')?.split_once('/')?;
    (!name.is_empty() && !method.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

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
