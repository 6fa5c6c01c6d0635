//! TLS termination (`server.tls`): rustls through Pingora, TLS 1.2 and 1.3,
//! with a certificate that a reload can swap. The listener asks
//! [`Certificate`] for the key of each handshake; a reload reads the files
//! again and swaps them in only when they parse and match, so a broken
//! certificate is a rejected reload and the old one keeps serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// `server.tls`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The TLS listeners.
    pub listen: Vec<std::net::SocketAddr>,
    /// The PEM certificate chain.
    pub cert_file: PathBuf,
    /// The PEM private key.
    pub key_file: PathBuf,
}

/// Why a certificate and key cannot be served; each message starts with
/// the file (or files) at fault.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// The certificate file cannot be read, or is not PEM.
    #[error("{}: {source}", path.display())]
    Read {
        /// The certificate file.
        path: PathBuf,
        /// Why it cannot be read.
        source: pem::Error,
    },
    /// The certificate file holds no certificate.
    #[error("{}: no certificate", path.display())]
    NoCertificate {
        /// The certificate file.
        path: PathBuf,
    },
    /// The key file cannot be read, or holds no PEM private key.
    #[error("{}: {source}", path.display())]
    ReadKey {
        /// The key file.
        path: PathBuf,
        /// Why it cannot be read.
        source: pem::Error,
    },
    /// The key is of a type that cannot sign.
    #[error("{}: {source}", path.display())]
    UnsupportedKey {
        /// The key file.
        path: PathBuf,
        /// Why the key cannot sign.
        source: Box<rustls::Error>,
    },
    /// The key is not the certificate's.
    #[error("{} and {}: {source}", cert.display(), key.display())]
    Mismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// How they differ.
        source: Box<rustls::Error>,
    },
}

/// The served certificate, swapped whole on reload.
#[derive(Debug)]
pub struct Certificate {
    current: ArcSwap<CertifiedKey>,
}

impl Certificate {
    /// Reads the certificate chain and key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, CertError> {
        Ok(Self {
            current: ArcSwap::from_pointee(certified_key(cert, key)?),
        })
    }

    /// Reads the files again; the old certificate stays when they do not
    /// make a valid pair.
    pub fn reload(&self, cert: &Path, key: &Path) -> Result<(), CertError> {
        self.current.store(Arc::new(certified_key(cert, key)?));
        Ok(())
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A certificate chain and its private key, checked to belong together.
fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, CertError> {
    let read = |source: pem::Error| CertError::Read {
        path: cert.to_owned(),
        source,
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(read)?
        .collect::<Result<_, _>>()
        .map_err(read)?;
    if chain.is_empty() {
        return Err(CertError::NoCertificate {
            path: cert.to_owned(),
        });
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|source| CertError::ReadKey {
        path: key.to_owned(),
        source,
    })?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key_der).map_err(|e| {
        CertError::UnsupportedKey {
            path: key.to_owned(),
            source: Box::new(e),
        }
    })?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| CertError::Mismatch {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source: Box::new(e),
    })?;
    Ok(certified)
}
