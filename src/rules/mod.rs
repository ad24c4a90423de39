//! The little languages of routes, and request data read exactly:
//!
//! - [`template`]: templates (`{body.customer}`, `{path.id}`, `{header.x}`) over a request.
//! - [`body`]: body paths (`body.inputs[*].id`) and how a body is read by its type (JSON, form).
//! - [`pattern`]: path patterns of routes (`/v1/customers/{id}`) and the path safety check.
//! - [`shape`]: a reconciled write's answer shaped from its read.
//! - [`urlencoded`]: form and query fields as the bytes their escapes spell (never lossy text).
//! - [`number`]: JSON numbers by value (`9801.0` is `9801`).

pub mod body;
pub mod number;
pub mod pattern;
pub mod shape;
pub mod template;
pub mod urlencoded;
