//! A thin wrapper over the generated `EngineClient`.

use tonic::transport::{Channel, Endpoint};

use crate::error::ClientError;
use crate::pb::{
    self, engine_client::EngineClient, generate_request::Input, generate_response::Response,
    GenerateRequest, GenerateResponse,
};

/// A connection to one v41 server; cheap to clone (clones share the HTTP/2 connection).
#[derive(Clone, Debug)]
pub struct Client {
    inner: EngineClient<Channel>,
}

/// One finished completion: the `Complete` message plus the chunks' text when streamed.
#[derive(Clone, Debug, Default)]
pub struct Completion {
    pub complete: pb::Complete,
    /// Concatenated `Chunk.text` (streaming); equals `complete.text`.
    pub streamed_text: String,
}

impl Client {
    /// Connect to `addr` (e.g. `http://127.0.0.1:8000`).
    pub async fn connect(addr: &str) -> Result<Self, ClientError> {
        let connect_err = |source| ClientError::Connect {
            addr: addr.to_string(),
            source,
        };
        let channel = Endpoint::from_shared(addr.to_string())
            .map_err(connect_err)?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(connect_err)?;
        Ok(Self {
            inner: EngineClient::new(channel),
        })
    }

    /// Start a `Generate` call; the caller reads the response stream.
    pub async fn generate_stream(
        &mut self,
        request: GenerateRequest,
    ) -> Result<tonic::Streaming<GenerateResponse>, ClientError> {
        Ok(self.inner.generate(request).await?.into_inner())
    }

    /// Run one `Generate` to the end, calling `on_chunk` for every chunk; returns the completions in
    /// index order. Errors when the stream ends before every completion sent its `Complete`.
    pub async fn generate(
        &mut self,
        request: GenerateRequest,
        mut on_chunk: impl FnMut(&pb::Chunk),
    ) -> Result<Vec<Completion>, ClientError> {
        let n = request
            .sampling_params
            .as_ref()
            .and_then(|p| p.n)
            .unwrap_or(1) as usize;
        let mut stream = self.generate_stream(request).await?;
        let mut texts = vec![String::new(); n];
        let mut done: Vec<Option<pb::Complete>> = vec![None; n];
        while let Some(msg) = stream.message().await? {
            match msg.response {
                Some(Response::Chunk(chunk)) => {
                    if let Some(t) = texts.get_mut(chunk.index as usize) {
                        t.push_str(&chunk.text);
                    }
                    on_chunk(&chunk);
                }
                Some(Response::Complete(c)) => {
                    let i = c.index as usize;
                    if i >= n || done[i].is_some() {
                        return Err(ClientError::Protocol(format!(
                            "unexpected Complete for index {i}"
                        )));
                    }
                    done[i] = Some(c);
                }
                None => return Err(ClientError::Protocol("empty GenerateResponse".into())),
            }
        }
        done.into_iter()
            .zip(texts)
            .enumerate()
            .map(|(i, (c, streamed_text))| match c {
                Some(complete) => Ok(Completion {
                    complete,
                    streamed_text,
                }),
                None => Err(ClientError::Protocol(format!(
                    "stream ended without Complete for index {i}"
                ))),
            })
            .collect()
    }

    pub async fn model_info(&mut self) -> Result<pb::ModelInfo, ClientError> {
        Ok(self
            .inner
            .get_model_info(pb::GetModelInfoRequest {})
            .await?
            .into_inner())
    }

    pub async fn loads(&mut self) -> Result<pb::Loads, ClientError> {
        Ok(self
            .inner
            .get_loads(pb::GetLoadsRequest {})
            .await?
            .into_inner())
    }

    pub async fn abort(
        &mut self,
        request_ids: Vec<String>,
        reason: &str,
    ) -> Result<(), ClientError> {
        let req = pb::AbortRequest {
            request_ids,
            reason: reason.to_string(),
        };
        self.inner.abort(req).await?;
        Ok(())
    }
}

/// A `GenerateRequest` for raw text (the server prepends BOS) or token ids.
pub fn request(input: Input, params: pb::SamplingParams, stream: bool) -> GenerateRequest {
    GenerateRequest {
        input: Some(input),
        sampling_params: Some(params),
        stream,
        ..Default::default()
    }
}
