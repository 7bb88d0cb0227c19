//! The HTTP surface: routes, API-key check, body limit, JSON 404/405, per-route response counts,
//! and the small GET endpoints.

use crate::error::ApiError;
use crate::scheduler::{Scheduler, SubmitError};
use crate::{chat_api, completions_api};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use smoe_engine::chat::ChatTemplate;
use smoe_engine::sampler::SamplerConfig;
use smoe_engine::tokenizer::Tokenizer;
use std::sync::Arc;

/// Everything a request handler needs; the model itself lives on the engine thread.
pub struct AppState {
    pub sched: Scheduler,
    pub tok: Tokenizer,
    pub template: ChatTemplate,
    /// Whether the template renders `tools` itself; if not, we describe them in the system
    /// message (see `tools::render_tools_into_messages`).
    pub template_has_tools: bool,
    pub model_id: String,
    pub created: u64,
    pub api_key: Option<String>,
    pub defaults: SamplerConfig,
    pub eos: Vec<u32>,
}

pub type Shared = Arc<AppState>;

pub fn router(state: Shared, max_body: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_api::handle))
        .route("/v1/completions", post(completions_api::handle))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// With --api-key, everything but /health needs `Authorization: Bearer KEY`.
async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                // The scheme is case-insensitive (RFC 9110): `bearer KEY` too.
                .and_then(|v| v.split_once(' '))
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, key)| key.trim());
            if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
                let msg = if given.is_none() {
                    "You didn't provide an API key: send it as 'Authorization: Bearer KEY'"
                } else {
                    "Incorrect API key provided"
                };
                return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", msg)
                    .with_code("invalid_api_key")
                    .into_response();
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts responses by route (a fixed set, so clients cannot blow up the label space).
async fn count(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let route = match req.uri().path() {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/health" => "/health",
        "/metrics" => "/metrics",
        _ => "other",
    };
    let resp = next.run(req).await;
    st.sched.stats.record_http(route, resp.status().as_u16());
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("no such endpoint: {} {}", req.method(), req.uri().path()),
    )
    .with_code("unknown_url")
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

fn model_json(st: &AppState) -> serde_json::Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "smoe",
           "max_model_len": st.sched.ctx})
}

/// A 200 with a JSON body.
pub fn json_ok(v: &serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn models(State(st): State<Shared>) -> Response {
    json_ok(&json!({"object": "list", "data": [model_json(&st)]}))
}

async fn model(State(st): State<Shared>, Path(id): Path<String>) -> Result<Response, ApiError> {
    if id != st.model_id {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model '{id}' does not exist"),
        )
        .with_code("model_not_found"));
    }
    Ok(json_ok(&model_json(&st)))
}

async fn health() -> Response {
    json_ok(&json!({"status": "ok"}))
}

async fn metrics(State(st): State<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.sched.stats.render(&st.model_id),
    )
}

/// A rejected body (too large, unreadable) as an OpenAI error with the right status.
pub fn body_rejection(r: axum::extract::rejection::BytesRejection) -> ApiError {
    let status = r.status();
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is too large".to_string()
    } else {
        format!("cannot read the request body: {}", r.body_text())
    };
    ApiError::new(status, "invalid_request_error", msg)
}

pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is busy (request queue full); retry later",
        ),
        SubmitError::Stopped => ApiError::server("the engine has stopped"),
    }
}
