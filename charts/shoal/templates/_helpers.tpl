{{/* Chart name, truncated to a DNS label. */}}
{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shoal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of the operator's own objects. */}}
{{- define "shoal.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end }}

{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shoal.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag or repository@digest; the tag defaults to the chart's appVersion. */}}
{{- define "shoal.image" -}}
{{- $img := index . 0 }}{{- $root := index . 1 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default $root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/*
Namespaces the operator watches, as a JSON list ("[]" means every namespace).
With rbac.scope=namespace an empty list means the release namespace.
*/}}
{{- define "shoal.watchNamespaces" -}}
{{- $ns := .Values.operator.watchNamespaces }}
{{- if and (eq .Values.rbac.scope "namespace") (empty $ns) }}
{{- $ns = list .Release.Namespace }}
{{- end }}
{{- toJson (uniq $ns) }}
{{- end }}

{{/*
The operator's permissions, shared by the ClusterRole and the namespaced Roles. Least privilege: only what the
handlers and kopf itself use.
*/}}
{{- define "shoal.rbacRules" -}}
# InferenceServices: kopf watches them and patches them (progress annotations, finalizer); status is written
# through the status subresource.
- apiGroups: [serving.shoal.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.shoal.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion, which clusters with the
# OwnerReferencesPermissionEnforcement admission plugin only allow with update on the owner's finalizers.
- apiGroups: [serving.shoal.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
# Children rendered from an InferenceService (ConfigMaps: chat templates; PersistentVolumeClaims: the shared model
# cache), written with server-side apply (create, patch) and read from watches only (no get).
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, persistentvolumeclaims]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch, delete]
# shoal-gateway's identity per InferenceService: a ServiceAccount and a Role + RoleBinding that let it list and
# watch EndpointSlices (granted through the autoscaler's EndpointSlice rule below: RBAC only lets the operator grant
# what it holds itself).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, watch, create, patch, delete]
# Engine pods: watched for status (ImagePullBackOff, probe failures), deleted to restart a multi-pod group,
# annotated with a deletion cost by the autoscaler (a scale-down removes the least busy pods).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch, delete]
# The autoscaler lists the engine and gateway endpoints it scrapes from their Services' EndpointSlices.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
# Events on InferenceServices (kopf's own and the handlers'); listed for a StatefulSet's FailedCreate.
- apiGroups: [""]
  resources: [events]
  verbs: [list, create, patch]
# spec.inferencePool: an InferencePool and an HTTPRoute for a Gateway that runs the inference extension (watched
# once their CRDs exist).
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [list, watch, create, patch, delete]
{{- if and .Values.highAvailability.enabled (eq .Values.rbac.scope "namespace") }}
# kopf peering of the operator replicas (highAvailability): keep-alives in the KopfPeering's status.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- end }}

{{/*
Cluster-scoped reads kopf uses to follow CRDs (resource discovery) and namespaces at run time. The namespaced
variant (rbac.scope=namespace) goes without: kopf then scans resources once at start-up and treats the
-n names literally, which is all a namespaced operator needs.
*/}}
{{- define "shoal.rbacClusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.highAvailability.enabled }}
# kopf peering of the operator replicas (highAvailability): keep-alives in the ClusterKopfPeering's status.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, patch]
{{- end }}
{{- if .Values.operator.watchNamespaces }}
# kopf resolves the -n names against the cluster's namespaces (with -A it never reads them)
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end }}

{{/* Selects the Services the operator renders whose pods serve /metrics (see operator/render.py): `<name>`
(the gateway pods, or the rank-0 engines when the gateway is disabled) and `<name>-engines` (the rank-0 engines
behind the gateway). */}}
{{- define "shoal.gatewaySelector" -}}
matchLabels:
  app.kubernetes.io/managed-by: shoal-operator
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: [gateway, engines]
{{- end }}

{{/* The shared gateway (sharedGateway.enabled): its name, labels and ServiceAccount. Its pods carry
app.kubernetes.io/component: shared-gateway, which every engine NetworkPolicy admits (the operator's
--shared-gateway). */}}
{{- define "shoal.sharedGateway.name" -}}
{{- printf "%s-gateway" (include "shoal.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shoal.sharedGateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: shared-gateway
{{- end }}

{{- define "shoal.sharedGateway.labels" -}}
helm.sh/chart: {{ include "shoal.chart" . }}
{{ include "shoal.sharedGateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end }}
